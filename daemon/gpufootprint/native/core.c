/*
 * The daemon's per-record loops in C (gpufootprint/native/__init__.py loads it with ctypes).
 *
 * The reuse tracker (features/reuse.py) decides, for every device allocation of a MEMORY batch, whether
 * its (address, size) was released before. In Python that is a loop over the records (small batches) or
 * a dozen numpy passes over a numpy hash set (large ones): about a fifth of a replay's time under
 * allocation churn (bench/replay_stages.py). Here one call counts the batch's records and then walks them
 * in place (gathered and sorted only when out of time order), with the same rule as
 * ReuseTracker._add_small, which stays the reference (tests/unit/engines/test_reuse_native.py holds the
 * two equal on random batches).
 *
 * No Python header, no Python link: one file serves every Python 3. Not thread-safe: the caller (one
 * tracker) holds the GIL for the whole call (the library is loaded with ctypes.PyDLL).
 */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>

#define GFP_CORE_ABI 2 /* raised at every change of an exported signature: a stale library is refused */
#define MIX 0x9E3779B97F4A7C15ULL /* the key's mix of the size (the reuse rule's key, as in Python) */
#define MIN_BITS 10               /* a cleared table starts at 1,024 slots again, as features/keyset.py */
#define SORT_RUN 16               /* the merge sort's first runs are sorted by insertion */
#define SCRATCH_KEEP 8192         /* the sort's scratch for up to this many records (512 KiB) is kept between
                                     batches; a larger one is freed after its batch (bounded memory) */

/* Open addressing, linear probing, for uint64 keys, with a value per key when `vals` is set (the
 * sizeless map: address -> last allocated size). The slot value 0 means empty, so the key 0 lives in a
 * flag beside the table; `size` counts it too (the Python tracker's len() of its set and dict do). The
 * table doubles before it would pass half full. Nothing is ever deleted: the tracker only adds, and
 * clears the whole table. */
typedef struct {
    uint64_t *keys;
    uint64_t *vals;
    uint64_t mul; /* the table's own random odd multiplier (hash_multiplier) */
    int bits;
    int with_vals;
    uint64_t size;
    int zero;
    uint64_t zero_val;
} table;

/*
 * A random odd multiplier for a multiply-shift hash, one a table (and one a thread's batch workspace).
 * Addresses come from the probes' processes: with one fixed multiplier, a process could send addresses
 * k * MIX^-1 (MIX is odd, so it has an inverse mod 2**64) that all land in one slot, at every table size,
 * and each new one would walk the whole run: a review timed 1.8 s for one 65,536-record batch of them on
 * the ingest thread every process shares. A random odd multiplier makes multiply-shift a universal family
 * (Dietzfelbinger et al.): no set of addresses chosen without it collides more than any other.
 */
static uint64_t hash_multiplier(void) {
    static _Thread_local uint64_t state;
    if (state == 0) {
        uint64_t seed = 0;
        if (getrandom(&seed, sizeof seed, GRND_NONBLOCK) != (ssize_t)sizeof seed) {
            struct timespec ts;
            clock_gettime(CLOCK_MONOTONIC, &ts);
            seed = (uint64_t)ts.tv_nsec ^ ((uint64_t)ts.tv_sec << 32) ^ (uint64_t)(uintptr_t)&seed;
        }
        state = seed | 1;
    }
    /* splitmix64: each table its own multiplier from the thread's seed */
    uint64_t z = (state += 0x9E3779B97F4A7C15ULL);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return (z ^ (z >> 31)) | 1;
}

static int table_init(table *t, int bits) {
    uint64_t *keys = calloc((size_t)1 << bits, sizeof(uint64_t));
    uint64_t *vals = t->with_vals ? calloc((size_t)1 << bits, sizeof(uint64_t)) : NULL;
    if (!keys || (t->with_vals && !vals)) {
        free(keys);
        free(vals);
        return -1;
    }
    free(t->keys);
    free(t->vals);
    t->keys = keys;
    t->vals = vals;
    t->mul = hash_multiplier();
    t->bits = bits;
    t->size = 0;
    t->zero = 0;
    t->zero_val = 0;
    return 0;
}

static void table_free(table *t) {
    free(t->keys);
    free(t->vals);
    t->keys = t->vals = NULL;
}

static inline uint64_t home(const table *t, uint64_t key) { return (key * t->mul) >> (64 - t->bits); }

/* The slot holding `key`, or the empty slot where it would go (key != 0). */
static inline uint64_t slot_of(const table *t, uint64_t key) {
    uint64_t mask = ((uint64_t)1 << t->bits) - 1, s = home(t, key);
    while (t->keys[s] != 0 && t->keys[s] != key)
        s = (s + 1) & mask;
    return s;
}

/* Room for `more` keys without passing half full: grown (rehashed) here, before a batch, so that the
 * batch's walk never allocates and a failed allocation leaves the table as it was. */
static int table_reserve(table *t, uint64_t more) {
    uint64_t need = t->size + more;
    int bits = t->bits;
    while (((uint64_t)1 << bits) < 2 * need) {
        if (++bits > 40) /* past 2**39 keys: no memory holds it; refused, as a failed allocation */
            return -1;
    }
    if (bits == t->bits)
        return 0;
    table bigger = {NULL, NULL, 0, 0, t->with_vals, 0, 0, 0};
    if (table_init(&bigger, bits) != 0)
        return -1;
    for (uint64_t i = 0, n = (uint64_t)1 << t->bits; i < n; i++) {
        uint64_t k = t->keys[i];
        if (k == 0)
            continue;
        uint64_t s = slot_of(&bigger, k);
        bigger.keys[s] = k;
        if (bigger.vals)
            bigger.vals[s] = t->vals[i];
    }
    table_free(t);
    t->keys = bigger.keys;
    t->vals = bigger.vals;
    t->mul = bigger.mul; /* the keys were placed by it */
    t->bits = bits;
    return 0; /* size and the key 0's flag are unchanged */
}

static inline int table_has(const table *t, uint64_t key) {
    return key == 0 ? t->zero : t->keys[slot_of(t, key)] == key;
}

/* Insert or overwrite; the caller reserved the room. */
static inline void table_put(table *t, uint64_t key, uint64_t val) {
    if (key == 0) {
        t->size += !t->zero;
        t->zero = 1;
        t->zero_val = val;
        return;
    }
    uint64_t s = slot_of(t, key);
    if (t->keys[s] == 0) {
        t->keys[s] = key;
        t->size++;
    }
    if (t->vals)
        t->vals[s] = val;
}

static inline uint64_t table_get(const table *t, uint64_t key, uint64_t missing) {
    if (key == 0)
        return t->zero ? t->zero_val : missing;
    uint64_t s = slot_of(t, key);
    return t->keys[s] == key ? t->vals[s] : missing;
}

/* One device record, gathered for the sort when a batch is out of time order. */
typedef struct {
    uint64_t ts, addr, bytes;
    uint64_t op;
} rec;

typedef struct {
    table freed; /* keys of (address, size) released */
    table live;  /* address -> last allocated size, kept once a release without its size was seen */
    int sizeless;
    /* where the fields lie in a record (MEMORY_DTYPE), and the values of records.py's enums */
    int64_t off_ts, off_addr, off_bytes, off_op, off_mk;
    uint8_t device, alloc, release;
    rec *scratch; /* the gathered records and the sort's second half: 2 * cap */
    uint64_t scratch_cap;
} gfp_reuse;

int gfp_core_abi(void) { return GFP_CORE_ABI; }

/* The sha256 (16 hex digits) of the core.c this was built from, given by setup.py: native/__init__.py
 * refuses a library whose source beside it has changed since (a tree edited and not rebuilt). */
#ifndef GFP_CORE_SOURCE
#define GFP_CORE_SOURCE "unknown"
#endif
const char *gfp_core_source(void) { return GFP_CORE_SOURCE; }

gfp_reuse *gfp_reuse_new(int64_t off_ts, int64_t off_addr, int64_t off_bytes, int64_t off_op, int64_t off_mk,
                         int32_t device, int32_t alloc, int32_t release) {
    gfp_reuse *r = calloc(1, sizeof *r);
    if (!r)
        return NULL;
    r->live.with_vals = 1;
    if (table_init(&r->freed, MIN_BITS) != 0 || table_init(&r->live, MIN_BITS) != 0) {
        table_free(&r->freed);
        table_free(&r->live);
        free(r);
        return NULL;
    }
    r->off_ts = off_ts;
    r->off_addr = off_addr;
    r->off_bytes = off_bytes;
    r->off_op = off_op;
    r->off_mk = off_mk;
    r->device = (uint8_t)device;
    r->alloc = (uint8_t)alloc;
    r->release = (uint8_t)release;
    return r;
}

void gfp_reuse_free(gfp_reuse *r) {
    if (!r)
        return;
    table_free(&r->freed);
    table_free(&r->live);
    free(r->scratch);
    free(r);
}

/* Bounded memory: each table starts afresh (small again) once it holds `capacity` keys. 0, or -1 when
 * the small table could not be allocated (the old one is kept). */
int gfp_reuse_trim(gfp_reuse *r, uint64_t capacity) {
    int rc = 0;
    if (r->live.size >= capacity)
        rc |= table_init(&r->live, MIN_BITS);
    if (r->freed.size >= capacity)
        rc |= table_init(&r->freed, MIN_BITS);
    return rc;
}

static inline uint64_t load64(const uint8_t *p) {
    uint64_t v;
    memcpy(&v, p, sizeof v); /* records are packed: fields need not be aligned */
    return v;
}

/* A stable merge sort of `n` items of TYPE by their KEY member, defined for each array it sorts: runs of
 * SORT_RUN sorted by insertion, then merge passes alternating between `a` and `tmp` (ties from the left:
 * equal keys keep their order). The function returns the one of the two holding the sorted items. */
#define DEFINE_MERGE_SORT(NAME, TYPE, KEY)                                                                     \
    static TYPE *NAME(TYPE *a, TYPE *tmp, uint64_t n) {                                                       \
        for (uint64_t lo = 0; lo < n; lo += SORT_RUN) {                                                       \
            uint64_t hi = lo + SORT_RUN < n ? lo + SORT_RUN : n;                                              \
            for (uint64_t i = lo + 1; i < hi; i++) {                                                          \
                TYPE x = a[i];                                                                                \
                uint64_t j = i;                                                                               \
                while (j > lo && a[j - 1].KEY > x.KEY) {                                                      \
                    a[j] = a[j - 1];                                                                          \
                    j--;                                                                                      \
                }                                                                                             \
                a[j] = x;                                                                                     \
            }                                                                                                 \
        }                                                                                                     \
        for (uint64_t width = SORT_RUN; width < n; width *= 2) {                                              \
            for (uint64_t lo = 0; lo < n; lo += 2 * width) {                                                  \
                uint64_t mid = lo + width < n ? lo + width : n, hi = lo + 2 * width < n ? lo + 2 * width : n; \
                uint64_t i = lo, j = mid, k = lo;                                                             \
                while (i < mid && j < hi)                                                                     \
                    tmp[k++] = a[j].KEY < a[i].KEY ? a[j++] : a[i++];                                         \
                while (i < mid)                                                                               \
                    tmp[k++] = a[i++];                                                                        \
                while (j < hi)                                                                                \
                    tmp[k++] = a[j++];                                                                        \
            }                                                                                                 \
            TYPE *swap = a;                                                                                   \
            a = tmp;                                                                                          \
            tmp = swap;                                                                                       \
        }                                                                                                     \
        return a;                                                                                             \
    }

/* By time: equal times keep their order in the batch (the Python paths sort with a stable sort). */
DEFINE_MERGE_SORT(sort_by_ts, rec, ts)

/* One record in time order: ReuseTracker._add_small's loop body. Writes an event for an allocation. */
static inline void walk_one(gfp_reuse *r, uint64_t ts, uint64_t op, uint64_t addr, uint64_t bytes, uint8_t **out,
                            uint64_t *hits) {
    if (r->sizeless) {
        if (op == r->alloc)
            table_put(&r->live, addr, bytes);
        else if (op == r->release && bytes == 0)
            bytes = table_get(&r->live, addr, 0);
    }
    uint64_t key = addr ^ (bytes * MIX);
    if (op == r->alloc) {
        uint8_t hit = (uint8_t)table_has(&r->freed, key);
        memcpy(*out, &ts, 8); /* REUSE_EVENT_DTYPE: (ts <i8, reused ?), packed, 9 bytes */
        (*out)[8] = hit;
        *out += 9;
        *hits += hit;
    } else if (op == r->release) {
        table_put(&r->freed, key, 0);
    }
}

/*
 * Feed one MEMORY batch: `n` records of `stride` bytes from `recs`. Device records only, in time order
 * (stable); an allocation is a reuse when its key was freed by an earlier batch or an earlier release
 * of this one. Writes one (ts, reused) event per device allocation to `events` (room for `n`), and the
 * count of reuses to `*hits`. Returns the count of events, or -1 when memory ran out (before any state
 * changed but the tables' clears and the switch to remembering sizes, which the next batch would have
 * made anyway).
 */
int64_t gfp_reuse_add(gfp_reuse *r, const uint8_t *recs, uint64_t n, int64_t stride, uint64_t capacity,
                      uint8_t *events, uint64_t *hits) {
    uint64_t n_dev = 0, n_alloc = 0, n_rel = 0;
    int sorted = 1, sizeless_release = 0;
    uint64_t prev = 0;
    *hits = 0;
    for (uint64_t i = 0; i < n; i++) {
        const uint8_t *p = recs + (int64_t)i * stride;
        if (p[r->off_mk] != r->device)
            continue;
        uint64_t ts = load64(p + r->off_ts);
        sorted &= n_dev == 0 || ts >= prev;
        prev = ts;
        n_dev++;
        uint8_t op = p[r->off_op];
        if (op == r->alloc) {
            n_alloc++;
        } else if (op == r->release) {
            n_rel++;
            sizeless_release |= load64(p + r->off_bytes) == 0;
        }
    }
    if (n && !n_dev)
        return 0; /* as _add_small: a batch without device records leaves everything as it was */
    if (gfp_reuse_trim(r, capacity) != 0)
        return -1;
    if (sizeless_release)
        r->sizeless = 1;
    if (table_reserve(&r->freed, n_rel) != 0 || (r->sizeless && table_reserve(&r->live, n_alloc) != 0))
        return -1;
    uint8_t *out = events;
    if (sorted) { /* the common case: walked in place, nothing copied */
        for (uint64_t i = 0; i < n; i++) {
            const uint8_t *p = recs + (int64_t)i * stride;
            if (p[r->off_mk] != r->device)
                continue;
            walk_one(r, load64(p + r->off_ts), p[r->off_op], load64(p + r->off_addr), load64(p + r->off_bytes),
                     &out, hits);
        }
        return (int64_t)(out - events) / 9;
    }
    if (r->scratch_cap < n_dev) {
        rec *s = malloc(2 * n_dev * sizeof(rec));
        if (!s)
            return -1;
        free(r->scratch);
        r->scratch = s;
        r->scratch_cap = n_dev;
    }
    rec *a = r->scratch, *tmp = r->scratch + n_dev;
    uint64_t k = 0;
    for (uint64_t i = 0; i < n; i++) {
        const uint8_t *p = recs + (int64_t)i * stride;
        if (p[r->off_mk] != r->device)
            continue;
        a[k++] = (rec){load64(p + r->off_ts), load64(p + r->off_addr), load64(p + r->off_bytes), p[r->off_op]};
    }
    const rec *s = sort_by_ts(a, tmp, n_dev);
    for (uint64_t i = 0; i < n_dev; i++)
        walk_one(r, s[i].ts, s[i].op, s[i].addr, s[i].bytes, &out, hits);
    if (r->scratch_cap > SCRATCH_KEEP) {
        free(r->scratch);
        r->scratch = NULL;
        r->scratch_cap = 0;
    }
    return (int64_t)(out - events) / 9;
}

/* What the tracker holds, for tests and the daemon's introspection: [freed keys, live addresses, sizeless]. */
void gfp_reuse_counts(const gfp_reuse *r, uint64_t *out) {
    out[0] = r->freed.size;
    out[1] = r->live.size;
    out[2] = (uint64_t)r->sizeless;
}

int gfp_reuse_has(const gfp_reuse *r, uint64_t key) { return table_has(&r->freed, key); }

/* Slots walked past their home, summed over the keys the freed table holds: what a lookup pays. Tests hold
 * keys crafted against a fixed multiplier to what random keys cost (hash_multiplier says why). */
uint64_t gfp_reuse_displacement(const gfp_reuse *r) {
    const table *t = &r->freed;
    uint64_t mask = ((uint64_t)1 << t->bits) - 1, d = 0;
    for (uint64_t i = 0; i <= mask; i++)
        if (t->keys[i])
            d += (i - home(t, t->keys[i])) & mask;
    return d;
}

/* The live map's (address, size) pairs, up to `most`; returns how many it holds. */
uint64_t gfp_reuse_live(const gfp_reuse *r, uint64_t *addrs, uint64_t *sizes, uint64_t most) {
    uint64_t k = 0;
    if (r->live.zero && k < most) {
        addrs[k] = 0;
        sizes[k++] = r->live.zero_val;
    }
    for (uint64_t i = 0, n = (uint64_t)1 << r->live.bits; i < n && k < most; i++) {
        if (r->live.keys[i] != 0) {
            addrs[k] = r->live.keys[i];
            sizes[k++] = r->live.vals[i];
        }
    }
    return r->live.size;
}

/*
 * The footprint's bulk MEMORY batch (footprint/table.py, DeviceFootprint._apply_memory_native; the numpy
 * path _apply_memory_bulk and the record-by-record path _apply_memory_each stay the reference, and
 * tests/unit/test_large_batches.py and test_footprint.py hold the three equal). Two calls a batch:
 *
 *   gfp_bulk_plan   groups the records by address (a hash of address -> group, the records of a group in
 *                   their batch order: what numpy's stable sort by address gives), checks that allocations
 *                   and releases alternate at every address, and lists the addresses whose first record is
 *                   a release (they must be live: Python looks them up in its dict) and those whose first
 *                   record is an allocation (they must not be);
 *   gfp_bulk_apply  takes the looked-up (bytes, kind, ts, async) of the first list, walks the records in
 *                   batch order carrying each allocation's size, kind and async flag to its release, and
 *                   writes the signed resident deltas, the per-kind counts and byte sums, the async bytes,
 *                   the size mismatches, and the table's inserts and deletes. Python applies them.
 *
 * Neither call changes anything Python sees but the buffers it is handed: a batch refused (1: the per-record
 * path must take it; 2: the numpy path must) is refused before Python changed anything. The C path takes
 * only batches whose sizes stay below 2**63 in sum (2 otherwise): there int64 sums are exact, as the numpy
 * path's float64 ones are below 2**53, so the two agree to the byte. The state between the two calls lives
 * in a per-thread workspace (the calls keep the GIL; nothing runs a second plan in a thread before its
 * apply), freed after a batch of more than SCRATCH_KEEP records.
 */
#define BULK_KINDS 32  /* table.py _N_KINDS: a record of a kind at or above it goes to the per-record path */
#define BULK_HEAD 7    /* gfp_bulk_apply's out: [mismatches, addr, allocated, released, async+, async-, kinds] */

typedef struct {
    uint64_t addr;
    int64_t size;          /* the current allocation's bytes (gfp_bulk_apply's walk) */
    uint32_t first, last;  /* positions of the address's first and last record in the batch */
    uint32_t matched;      /* a group whose first record is a release: its row in the looked-up entries */
    uint8_t first_op, last_op, kind, async;
} bulk_group;

typedef struct {
    uint64_t key;
    uint64_t group;
} bulk_pair;

typedef struct {
    uint32_t *slots;      /* address hash: group index + 1, 0 empty */
    bulk_group *groups;
    uint32_t *rec_group;  /* each record's group */
    bulk_pair *pairs;     /* the inserts' sort: 2 * cap */
    uint64_t cap;         /* records the buffers hold */
    int bits;             /* slots: 1 << bits */
    uint64_t mul;         /* the address hash's random odd multiplier (hash_multiplier) */
    uint64_t n_groups, n_rel_first;
    const uint8_t *recs;  /* the planned batch (gfp_bulk_apply checks it is handed the same) */
    uint64_t n;
    int64_t stride;
    int planned;
} bulk_ws;

static _Thread_local bulk_ws bulk;
/* MEMORY_DTYPE's field offsets, MemoryOp's values, the resident kinds: set once (gfp_bulk_layout). */
static int64_t b_ts, b_addr, b_bytes, b_op, b_mk, b_async;
static uint8_t b_alloc, b_release;
static uint32_t b_resident;

void gfp_bulk_layout(int64_t off_ts, int64_t off_addr, int64_t off_bytes, int64_t off_op, int64_t off_mk,
                     int64_t off_async, int32_t alloc, int32_t release, uint32_t resident) {
    b_ts = off_ts;
    b_addr = off_addr;
    b_bytes = off_bytes;
    b_op = off_op;
    b_mk = off_mk;
    b_async = off_async;
    b_alloc = (uint8_t)alloc;
    b_release = (uint8_t)release;
    b_resident = resident;
}

static void bulk_free(bulk_ws *w) {
    free(w->slots);
    free(w->groups);
    free(w->rec_group);
    free(w->pairs);
    memset(w, 0, sizeof *w);
}

static void bulk_release_ws(void) { bulk_free(&bulk); }

/* A thread's workspace is freed when the thread ends (a key's destructor; _Thread_local storage has
 * none): a program that runs batches on short-lived threads would otherwise keep each one's. */
static pthread_key_t bulk_key;
static pthread_once_t bulk_key_once = PTHREAD_ONCE_INIT;
static int bulk_key_ok;
static void bulk_at_thread_exit(void *w) { bulk_free((bulk_ws *)w); }
static void bulk_key_make(void) { bulk_key_ok = pthread_key_create(&bulk_key, bulk_at_thread_exit) == 0; }

static int bulk_reserve(uint64_t n) {
    int bits = 4;
    while (((uint64_t)1 << bits) < 2 * n)
        bits++;
    if (bulk.cap >= n && bulk.bits >= bits && !(bulk.cap > SCRATCH_KEEP && n <= SCRATCH_KEEP))
        return 0;
    bulk_release_ws();
    uint64_t cap = n < 1024 ? 1024 : n;
    while (((uint64_t)1 << bits) < 2 * cap)
        bits++;
    bulk.slots = malloc(((size_t)1 << bits) * sizeof(uint32_t));
    bulk.groups = malloc(cap * sizeof(bulk_group));
    bulk.rec_group = malloc(cap * sizeof(uint32_t));
    bulk.pairs = malloc(2 * cap * sizeof(bulk_pair));
    if (!bulk.slots || !bulk.groups || !bulk.rec_group || !bulk.pairs) {
        bulk_release_ws();
        return -1;
    }
    bulk.cap = cap;
    bulk.bits = bits;
    bulk.mul = hash_multiplier();
    pthread_once(&bulk_key_once, bulk_key_make);
    if (bulk_key_ok && pthread_getspecific(bulk_key) == NULL)
        pthread_setspecific(bulk_key, &bulk);
    return 0;
}

/*
 * Plan one batch of `n` (>= 1, < 2**32) MEMORY records of `stride` bytes at `recs`. Writes to `firsts`
 * (room for n) the addresses whose first record is a release, from the front, in the order of their first
 * records, and those whose first record is an allocation, from the back; to `head`: [those two counts, the
 * addresses whose last record is an allocation (the inserts), the groups]. Returns 0; 1 where the per-record
 * path must take the batch (a memory kind >= 32, an op neither allocation nor release, two allocations or
 * two releases in a row at one address: the numpy path's None); 2 where the numpy path must (a size of
 * 2**63 or more); -1 out of memory.
 */
int64_t gfp_bulk_plan(const uint8_t *recs, uint64_t n, int64_t stride, uint64_t *firsts, uint64_t *head) {
    bulk.planned = 0;
    if (n == 0 || n >= ((uint64_t)1 << 32))
        return 2;
    if (bulk_reserve(n) != 0)
        return -1;
    memset(bulk.slots, 0, ((size_t)1 << bulk.bits) * sizeof(uint32_t));
    uint64_t mask = ((uint64_t)1 << bulk.bits) - 1, ng = 0, big = 0;
    uint32_t prev = 0; /* the group of the record before */
    int shift = 64 - bulk.bits;
    bulk_group *groups = bulk.groups;
    for (uint64_t i = 0; i < n; i++) {
        const uint8_t *p = recs + (int64_t)i * stride;
        uint8_t op = p[b_op];
        if (p[b_mk] >= BULK_KINDS || (op != b_alloc && op != b_release))
            return 1;
        big |= load64(p + b_bytes);
        uint64_t addr = load64(p + b_addr);
        uint32_t g;
        if (ng && addr == groups[prev].addr) {
            g = prev + 1; /* the record before's address (a release right after its allocation): no lookup */
        } else {
            uint64_t s = (addr * bulk.mul) >> shift;
            while ((g = bulk.slots[s]) != 0 && groups[g - 1].addr != addr)
                s = (s + 1) & mask;
            if (g == 0)
                bulk.slots[s] = (uint32_t)(ng + 1);
        }
        if (g == 0) {
            bulk_group *gr = &groups[ng];
            gr->addr = addr;
            gr->first = gr->last = (uint32_t)i;
            gr->first_op = gr->last_op = op;
            prev = (uint32_t)ng++;
        } else {
            bulk_group *gr = &groups[g - 1];
            if (gr->last_op == op)
                return 1; /* two allocations or two releases in a row at one address */
            gr->last = (uint32_t)i;
            gr->last_op = op;
            prev = g - 1;
        }
        bulk.rec_group[i] = prev;
    }
    if (big >> 63)
        return 2;
    uint64_t r = 0, a = 0, ins = 0;
    for (uint64_t g = 0; g < ng; g++) {
        if (groups[g].first_op == b_release) {
            groups[g].matched = (uint32_t)r;
            firsts[r++] = groups[g].addr;
        } else {
            firsts[n - 1 - a++] = groups[g].addr;
        }
        ins += groups[g].last_op == b_alloc;
    }
    head[0] = r;
    head[1] = a;
    head[2] = ins;
    head[3] = ng;
    bulk.n_groups = ng;
    bulk.n_rel_first = r;
    bulk.recs = recs;
    bulk.n = n;
    bulk.stride = stride;
    bulk.planned = 1;
    return 0;
}

DEFINE_MERGE_SORT(merge_by_key, bulk_pair, key)

/* Distinct keys, ascending (a merge sort; in place when already in order). Returns the sorted run. */
static bulk_pair *bulk_sort(bulk_pair *a, bulk_pair *tmp, uint64_t n) {
    uint64_t i = 1;
    while (i < n && a[i - 1].key < a[i].key)
        i++;
    return i >= n ? a : merge_by_key(a, tmp, n);
}

/*
 * Apply the planned batch (the same `recs`, `n`, `stride`). `matched`: for each address whose first record is
 * a release, in the plan's order, its live entry (bytes, kind, ts, async) as 4 int64. `each_order`: 0 as
 * the numpy path (inserts by ascending address, written over an entry in place; deletes of the addresses
 * that were live and end released; the first mismatch in (address, position) order), 1 as the record-by-record
 * path (every address that was live is deleted, the inserts follow in the order of their last records; the
 * first mismatch in batch order). Writes `deltas` (n, batch order), `out` (BULK_HEAD + 5 * 32: the head, then
 * per kind moved [kind, allocations, releases, bytes allocated, bytes released], kinds ascending), `ins`
 * (4 rows of head[2] words: address, bytes, kind, ts), `ins_async` (head[2] bytes), `dels` (the deleted
 * addresses; the count is returned). Returns the deletes' count, or -2 where the numpy path must take the
 * batch (sizes reaching 2**63, a looked-up entry out of range), -3 when not planned (nothing written that
 * Python reads).
 */
int64_t gfp_bulk_apply(const uint8_t *recs, uint64_t n, int64_t stride, const int64_t *matched, int32_t each_order,
                       int64_t *deltas, uint64_t *out, uint64_t *ins, uint8_t *ins_async, uint64_t *dels) {
    int planned = bulk.planned;
    bulk.planned = 0; /* one apply a plan */
    if (!planned || bulk.recs != recs || bulk.n != n || bulk.stride != stride)
        return -3;
    bulk_group *groups = bulk.groups;
    uint64_t ng = bulk.n_groups;
    for (uint64_t g = 0; g < ng; g++) {
        bulk_group *gr = &groups[g];
        if (gr->first_op != b_release)
            continue;
        const int64_t *m = matched + 4 * (uint64_t)gr->matched;
        if (m[0] < 0 || m[1] < 0 || m[1] >= BULK_KINDS)
            return -2;
        gr->size = m[0];
        gr->kind = (uint8_t)m[1];
        gr->async = m[3] != 0;
    }
    uint64_t na[BULK_KINDS] = {0}, nr[BULK_KINDS] = {0}, ab[BULK_KINDS] = {0}, rb[BULK_KINDS] = {0};
    uint64_t moved = 0, async_plus = 0, async_minus = 0, mm = 0, mm_addr = 0, mm_size = 0, mm_claimed = 0;
    uint64_t mm_pos = 0;
    for (uint64_t i = 0; i < n; i++) {
        const uint8_t *p = recs + (int64_t)i * stride;
        bulk_group *gr = &groups[bulk.rec_group[i]];
        uint64_t bytes = load64(p + b_bytes);
        int64_t size;
        uint8_t kind;
        if (p[b_op] == b_alloc) {
            size = (int64_t)bytes; /* below 2**63: the plan refused larger ones */
            kind = p[b_mk];
            gr->size = size;
            gr->kind = kind;
            gr->async = p[b_async] != 0;
            na[kind]++;
            ab[kind] += (uint64_t)size;
            deltas[i] = (b_resident >> kind) & 1 ? size : 0;
            if (gr->async)
                async_plus += (uint64_t)size;
        } else {
            size = gr->size;
            kind = gr->kind;
            if (bytes != 0 && bytes != (uint64_t)size) {
                if (mm == 0 || (!each_order && (gr->addr < mm_addr || (gr->addr == mm_addr && i < mm_pos)))) {
                    mm_addr = gr->addr;
                    mm_size = (uint64_t)size;
                    mm_claimed = bytes;
                    mm_pos = i;
                }
                mm++;
            }
            nr[kind]++;
            rb[kind] += (uint64_t)size;
            deltas[i] = (b_resident >> kind) & 1 ? -size : 0;
            if (gr->async)
                async_minus += (uint64_t)size;
        }
        moved += (uint64_t)size; /* each below 2**63: no wrap before the check */
        if (moved >> 63)
            return -2;
    }
    out[0] = mm;
    out[1] = mm_addr;
    out[2] = mm_size;
    out[3] = mm_claimed;
    out[4] = async_plus;
    out[5] = async_minus;
    uint64_t m = 0, *row = out + BULK_HEAD;
    for (int k = 0; k < BULK_KINDS; k++) {
        if (!(na[k] | nr[k]))
            continue;
        row[0] = (uint64_t)k;
        row[1] = na[k];
        row[2] = nr[k];
        row[3] = ab[k];
        row[4] = rb[k];
        row += 5;
        m++;
    }
    out[6] = m;
    /* The inserts: addresses whose last record allocates, in the order the path being matched inserts them */
    bulk_pair *pairs = bulk.pairs;
    uint64_t k = 0, d = 0;
    for (uint64_t g = 0; g < ng; g++) {
        const bulk_group *gr = &groups[g];
        if (gr->last_op == b_alloc)
            pairs[k++] = (bulk_pair){each_order ? gr->last : gr->addr, g};
        if (gr->first_op == b_release && (each_order || gr->last_op == b_release))
            dels[d++] = gr->addr;
    }
    const bulk_pair *sorted = bulk_sort(pairs, pairs + bulk.cap, k);
    for (uint64_t j = 0; j < k; j++) {
        const bulk_group *gr = &groups[sorted[j].group];
        ins[j] = gr->addr;
        ins[k + j] = (uint64_t)gr->size;
        ins[2 * k + j] = gr->kind;
        ins[3 * k + j] = load64(recs + (int64_t)gr->last * stride + b_ts);
        ins_async[j] = gr->async;
    }
    if (bulk.cap > SCRATCH_KEEP)
        bulk_release_ws();
    return (int64_t)d;
}

/* Whether any of `keys` (m) is an address of the planned batch: any one (`alloc_first` 0), or one whose
 * first record is an allocation (1). For the checks against the live table and the reused addresses when
 * those are few beside the batch: their keys looked up here instead of the batch's in Python. -3 when not
 * planned. */
/* The same for the address hash of this thread's last plan (valid until its next batch). */
uint64_t gfp_bulk_displacement(void) {
    if (!bulk.slots)
        return 0;
    uint64_t mask = ((uint64_t)1 << bulk.bits) - 1, d = 0;
    int shift = 64 - bulk.bits;
    for (uint64_t i = 0; i <= mask; i++) {
        uint32_t g = bulk.slots[i];
        if (g)
            d += (i - ((bulk.groups[g - 1].addr * bulk.mul) >> shift)) & mask;
    }
    return d;
}

int64_t gfp_bulk_hit(const uint64_t *keys, uint64_t m, int32_t alloc_first) {
    if (!bulk.planned)
        return -3;
    uint64_t mask = ((uint64_t)1 << bulk.bits) - 1;
    int shift = 64 - bulk.bits;
    for (uint64_t j = 0; j < m; j++) {
        uint64_t addr = keys[j], s = (addr * bulk.mul) >> shift;
        uint32_t g;
        while ((g = bulk.slots[s]) != 0 && bulk.groups[g - 1].addr != addr)
            s = (s + 1) & mask;
        if (g != 0 && (!alloc_first || bulk.groups[g - 1].first_op == b_alloc))
            return 1;
    }
    return 0;
}
