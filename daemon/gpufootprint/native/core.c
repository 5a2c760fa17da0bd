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
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define GFP_CORE_ABI 1 /* raised at every change of an exported signature: a stale library is refused */
#define MIX 0x9E3779B97F4A7C15ULL /* the key's mix of the size and the tables' Fibonacci hash */
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
    int bits;
    int with_vals;
    uint64_t size;
    int zero;
    uint64_t zero_val;
} table;

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

static inline uint64_t home(const table *t, uint64_t key) { return (key * MIX) >> (64 - t->bits); }

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
    while (((uint64_t)1 << bits) < 2 * need)
        bits++;
    if (bits == t->bits)
        return 0;
    table bigger = {NULL, NULL, 0, t->with_vals, 0, 0, 0};
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

/* Stable: equal times keep their order in the batch (the Python paths sort with a stable sort). The merge
 * passes alternate between `a` and `tmp`: returns the one holding the sorted records. */
static rec *sort_by_ts(rec *a, rec *tmp, uint64_t n) {
    for (uint64_t lo = 0; lo < n; lo += SORT_RUN) {
        uint64_t hi = lo + SORT_RUN < n ? lo + SORT_RUN : n;
        for (uint64_t i = lo + 1; i < hi; i++) {
            rec x = a[i];
            uint64_t j = i;
            while (j > lo && a[j - 1].ts > x.ts) {
                a[j] = a[j - 1];
                j--;
            }
            a[j] = x;
        }
    }
    for (uint64_t width = SORT_RUN; width < n; width *= 2) {
        for (uint64_t lo = 0; lo < n; lo += 2 * width) {
            uint64_t mid = lo + width < n ? lo + width : n, hi = lo + 2 * width < n ? lo + 2 * width : n;
            uint64_t i = lo, j = mid, k = lo;
            while (i < mid && j < hi)
                tmp[k++] = a[j].ts < a[i].ts ? a[j++] : a[i++]; /* ties from the left: stable */
            while (i < mid)
                tmp[k++] = a[i++];
            while (j < hi)
                tmp[k++] = a[j++];
        }
        rec *swap = a;
        a = tmp;
        tmp = swap;
    }
    return a;
}

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
 * changed but the tables' clears, which the next batch would have made anyway).
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
