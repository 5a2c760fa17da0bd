from gpufootprint.cli import main

raise SystemExit(main())
