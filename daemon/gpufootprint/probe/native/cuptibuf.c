/*
 * gpufootprint's CUPTI activity-buffer callbacks in C: CUPTI's threads never run Python.
 *
 * CUPTI calls the buffer callbacks on whichever thread records or flushes: a thread of the
 * program inside cudaMalloc (perhaps under its framework's allocator lock), a C++ runtime
 * thread that never held the GIL, CUPTI's own worker. A Python callback there must take the
 * GIL first: it waits behind the program's Python thread (up to the interpreter's switch
 * interval), and it can deadlock against a thread that holds the GIL and waits for that
 * allocator lock (docs/probe.md, "Why the buffer callbacks are C").
 *
 * Here `requested` hands out a buffer from a bounded pool and `completed` queues
 * (address, valid bytes) and writes to an eventfd that wakes the probe's sender thread. Both
 * take one mutex for a few loads and stores, never call into Python, never block on I/O (the
 * eventfd is non-blocking), and never fail into CUPTI. The sender takes the queued buffers
 * (gfp_take), reads them in Python on its own thread, and gives each back (gfp_give_back).
 *
 * CUPTI's callbacks carry no user pointer, so each pool gets a pair of entry points of its own: one of
 * GFP_SLOTS pairs below, each reading its slot's pool (gfp_callbacks). A process registers one pool
 * with CUPTI; tests run several at once, each with its own fake CUPTI.
 * Loaded with ctypes (probe/nativecallbacks.py); no Python headers, no CUPTI headers: the two
 * callback signatures are CUPTI's documented ones with its opaque types as void pointers.
 */
#include <errno.h>
#include <limits.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define GFP_ABI 7 /* raised at every change of an exported signature: a stale library is refused, not misread */
#define GFP_MAX_QUEUES 256
#define GFP_SLOTS 64
#define GFP_MAX_KINDS 1024 /* CUPTI's activity kinds number under a hundred */

typedef struct {
    uint64_t address;
    uint64_t valid;
} gfp_done;

typedef struct {
    uint64_t ctx;
    uint32_t stream;
} gfp_queue;

struct gfp_fwd;

typedef struct gfp_pool {
    pthread_mutex_t mu;
    size_t buffer_bytes;
    int max_buffers;
    int wake_fd;
    /* every buffer ever allocated (aligned address, and malloc's own pointer to free) */
    uint64_t *ours;
    void **raw;
    int allocated;
    uint64_t *free_list;
    int n_free;
    /* completed, not yet taken: a ring (each buffer is in it at most once, so max_buffers suffice) */
    gfp_done *done;
    int done_head;
    int n_done;
    gfp_queue queues[GFP_MAX_QUEUES];
    int n_queues;
    /* counters, read by gfp_stats */
    uint64_t requested, completed, refused, foreign, empty, queues_overflow, wake_errors;
    int slot;
    /* the forwarder (gfp_fwd_new), when one reads the completed buffers instead of the sender; `queued` counts
     * every buffer put in the ring (a forwarder's sync waits for what it had queued when asked) */
    struct gfp_fwd *fwd;
    uint64_t queued;
} gfp_pool;

/* Each pool's slot: its entry points read it. A slot is reused after GFP_SLOTS more pools (a pool's
 * callbacks then serve the newer pool): only a process that made 64 pools since can see that. */
static gfp_pool *slots[GFP_SLOTS];
static int next_slot;

int gfp_abi(void) { return GFP_ABI; }

gfp_pool *gfp_new(uint64_t buffer_bytes, int max_buffers, int wake_fd) {
    if (buffer_bytes < 8 || max_buffers < 1) return NULL;
    gfp_pool *p = calloc(1, sizeof(*p));
    if (!p) return NULL;
    p->ours = calloc((size_t)max_buffers, sizeof(uint64_t));
    p->raw = calloc((size_t)max_buffers, sizeof(void *));
    p->free_list = calloc((size_t)max_buffers, sizeof(uint64_t));
    p->done = calloc((size_t)max_buffers, sizeof(gfp_done));
    if (!p->ours || !p->raw || !p->free_list || !p->done || pthread_mutex_init(&p->mu, NULL) != 0) {
        free(p->ours); free(p->raw); free(p->free_list); free(p->done); free(p);
        return NULL;
    }
    p->buffer_bytes = (size_t)buffer_bytes;
    p->max_buffers = max_buffers;
    p->wake_fd = wake_fd;
    /* A pool is never freed: CUPTI may call a registered callback until the process ends, and
     * buffers it still holds point into the pool. */
    p->slot = __atomic_fetch_add(&next_slot, 1, __ATOMIC_RELAXED) % GFP_SLOTS;
    __atomic_store_n(&slots[p->slot], p, __ATOMIC_RELEASE);
    return p;
}

static int is_ours(const gfp_pool *p, uint64_t address) {
    for (int i = 0; i < p->allocated; i++)
        if (p->ours[i] == address) return 1;
    return 0;
}

static void note_queue(gfp_pool *p, uint64_t ctx, uint32_t stream) {
    for (int i = 0; i < p->n_queues; i++)
        if (p->queues[i].ctx == ctx && p->queues[i].stream == stream) return;
    if (p->n_queues < GFP_MAX_QUEUES) {
        p->queues[p->n_queues].ctx = ctx;
        p->queues[p->n_queues].stream = stream;
        p->n_queues++;
    } else {
        p->queues_overflow++;
    }
}

/* CUpti_BuffersCallbackRequestFunc, for pool p */
static void requested(gfp_pool *p, uint8_t **buffer, size_t *size, size_t *max_records) {
    uint64_t address = 0;
    if (p) {
        pthread_mutex_lock(&p->mu);
        p->requested++;
        if (p->n_free > 0) {
            address = p->free_list[--p->n_free];
        } else if (p->allocated < p->max_buffers) {
            void *raw = malloc(p->buffer_bytes + 8);
            if (raw) {
                address = ((uint64_t)(uintptr_t)raw + 7) & ~(uint64_t)7; /* CUPTI wants 8-byte alignment */
                p->raw[p->allocated] = raw;
                p->ours[p->allocated] = address;
                p->allocated++;
            }
        }
        if (!address) p->refused++; /* no buffer: CUPTI drops the records and counts them */
        pthread_mutex_unlock(&p->mu);
    }
    *buffer = (uint8_t *)(uintptr_t)address;
    *size = address ? p->buffer_bytes : 0;
    *max_records = 0;
}

static void gfp_fwd_signal(struct gfp_fwd *f);

/* A ring of (address, valid) of `max` slots from `head`, `*n` in it (the pool's completed buffers, the forwarder's
 * handed-over ones: each buffer is in a ring at most once, so the pool's buffer count suffices). */
static void ring_push(gfp_done *ring, int head, int *n, int max, uint64_t address, uint64_t valid) {
    gfp_done *slot = &ring[(head + *n) % max];
    slot->address = address;
    slot->valid = valid;
    (*n)++;
}

static gfp_done ring_pop(gfp_done *ring, int *head, int *n, int max) {
    gfp_done d = ring[*head];
    *head = (*head + 1) % max;
    (*n)--;
    return d;
}

/* Up to `most` of the ring's oldest into out[2*i] (address), out[2*i+1] (valid); how many. */
static int ring_take(gfp_done *ring, int *head, int *n, int max, uint64_t *out, int most) {
    int taken = 0;
    for (; taken < most && *n > 0; taken++) {
        gfp_done d = ring_pop(ring, head, n, max);
        out[2 * taken] = d.address;
        out[2 * taken + 1] = d.valid;
    }
    return taken;
}

/* Wake the sender (the pool's mutex held: once gfp_retire returns no write can reach a closed, or reused, fd).
 * Non-blocking: EAGAIN means the counter is at its maximum, the sender is awake anyway. */
static void wake_sender(gfp_pool *p) {
    if (p->wake_fd >= 0) {
        uint64_t one = 1;
        if (write(p->wake_fd, &one, sizeof(one)) != (ssize_t)sizeof(one) && errno != EAGAIN)
            p->wake_errors++;
    }
}

/* CUpti_BuffersCallbackCompleteFunc, for pool p */
static void completed(gfp_pool *p, void *ctx, uint32_t stream, uint8_t *buffer, size_t size, size_t valid) {
    (void)size;
    if (!p) return;
    uint64_t address = (uint64_t)(uintptr_t)buffer;
    int wake = 0;
    pthread_mutex_lock(&p->mu);
    p->completed++;
    note_queue(p, (uint64_t)(uintptr_t)ctx, stream);
    if (!address || !is_ours(p, address)) {
        p->foreign++; /* another tool's buffer (it registered its own callbacks): not ours to read or free */
    } else if (valid == 0) {
        p->empty++;
        p->free_list[p->n_free++] = address;
    } else {
        ring_push(p->done, p->done_head, &p->n_done, p->max_buffers, address,
                  valid < p->buffer_bytes ? valid : p->buffer_bytes);
        p->queued++;
        wake = 1;
    }
    if (wake && p->fwd) {
        gfp_fwd_signal(p->fwd); /* the forwarder reads it, and wakes the sender only when the sender must act */
    } else if (wake) {
        wake_sender(p);
    }
    pthread_mutex_unlock(&p->mu);
}

/* The entry points of the slots: CUPTI's two signatures, each bound to its slot's pool. */
typedef void (*gfp_requested_fn)(uint8_t **, size_t *, size_t *);
typedef void (*gfp_completed_fn)(void *, uint32_t, uint8_t *, size_t, size_t);
#define GFP_SLOT(a, b)                                                                             \
    static void requested_##a##_##b(uint8_t **buffer, size_t *size, size_t *max_records) {         \
        requested(__atomic_load_n(&slots[(a) * 8 + (b)], __ATOMIC_ACQUIRE), buffer, size, max_records); \
    }                                                                                              \
    static void completed_##a##_##b(void *ctx, uint32_t stream, uint8_t *buffer, size_t size,      \
                                    size_t valid) {                                                \
        completed(__atomic_load_n(&slots[(a) * 8 + (b)], __ATOMIC_ACQUIRE), ctx, stream, buffer, size, valid); \
    }
#define GFP_SLOTS8(a) \
    GFP_SLOT(a, 0) GFP_SLOT(a, 1) GFP_SLOT(a, 2) GFP_SLOT(a, 3) GFP_SLOT(a, 4) GFP_SLOT(a, 5) GFP_SLOT(a, 6) GFP_SLOT(a, 7)
GFP_SLOTS8(0) GFP_SLOTS8(1) GFP_SLOTS8(2) GFP_SLOTS8(3) GFP_SLOTS8(4) GFP_SLOTS8(5) GFP_SLOTS8(6) GFP_SLOTS8(7)
#define GFP_ROW(f, a) f##_##a##_0, f##_##a##_1, f##_##a##_2, f##_##a##_3, f##_##a##_4, f##_##a##_5, f##_##a##_6, f##_##a##_7
#define GFP_TABLE(f) \
    {GFP_ROW(f, 0), GFP_ROW(f, 1), GFP_ROW(f, 2), GFP_ROW(f, 3), GFP_ROW(f, 4), GFP_ROW(f, 5), GFP_ROW(f, 6), GFP_ROW(f, 7)}
static const gfp_requested_fn requested_at[GFP_SLOTS] = GFP_TABLE(requested);
static const gfp_completed_fn completed_at[GFP_SLOTS] = GFP_TABLE(completed);

/* The pool's two callbacks, to register with cuptiActivityRegisterCallbacks. */
void gfp_callbacks(gfp_pool *p, gfp_requested_fn *requested_fn, gfp_completed_fn *completed_fn) {
    *requested_fn = requested_at[p->slot];
    *completed_fn = completed_at[p->slot];
}

/* The sender has stopped: no more wakes (its eventfd may be closed once this returns). Buffers
 * CUPTI completes from now on are still queued, up to the pool's bound, and never read. */
void gfp_retire(gfp_pool *p) {
    pthread_mutex_lock(&p->mu);
    p->wake_fd = -1;
    pthread_mutex_unlock(&p->mu);
}

/* The sender: up to `most` completed buffers, oldest first, into out[2*i] (address), out[2*i+1] (valid). */
int gfp_take(gfp_pool *p, uint64_t *out, int most) {
    pthread_mutex_lock(&p->mu);
    int n = ring_take(p->done, &p->done_head, &p->n_done, p->max_buffers, out, most);
    pthread_mutex_unlock(&p->mu);
    return n;
}

/* The sender is done with a buffer: 0, or -1 if it is not one of this pool's (left alone). */
int gfp_give_back(gfp_pool *p, uint64_t address) {
    int rc = -1;
    pthread_mutex_lock(&p->mu);
    if (is_ours(p, address) && p->n_free < p->max_buffers) {
        p->free_list[p->n_free++] = address;
        rc = 0;
    }
    pthread_mutex_unlock(&p->mu);
    return rc;
}

/* Counters: requested, completed, refused, foreign, empty, allocated, free, queued, queues_overflow, wake_errors. */
#define GFP_STATS 10
int gfp_stats(gfp_pool *p, uint64_t *out, int n) {
    uint64_t v[GFP_STATS];
    pthread_mutex_lock(&p->mu);
    v[0] = p->requested; v[1] = p->completed; v[2] = p->refused; v[3] = p->foreign; v[4] = p->empty;
    v[5] = (uint64_t)p->allocated; v[6] = (uint64_t)p->n_free; v[7] = (uint64_t)p->n_done;
    v[8] = p->queues_overflow; v[9] = p->wake_errors;
    pthread_mutex_unlock(&p->mu);
    if (n > GFP_STATS) n = GFP_STATS;
    memcpy(out, v, (size_t)n * sizeof(uint64_t));
    return GFP_STATS;
}

/* The (CUcontext, stream) queues buffers completed on (CUPTI counts its drops per queue). */
int gfp_queues(gfp_pool *p, uint64_t *ctx, uint32_t *stream, int most) {
    int n;
    pthread_mutex_lock(&p->mu);
    n = p->n_queues < most ? p->n_queues : most;
    for (int i = 0; i < n; i++) {
        ctx[i] = p->queues[i].ctx;
        stream[i] = p->queues[i].stream;
    }
    pthread_mutex_unlock(&p->mu);
    return n;
}

/* Each kind's record offsets in buf[0:valid], for the sender's read of a buffer (the same answer as
 * wire/cupti_layout.walk, in one pass: a buffer whose kinds are mixed unevenly, as allocation calls' API
 * records mix with MEMORY2 records when PyTorch's cache is off, costs Python a loop step a record).
 * sizes[k]: the struct size of kind k (< nsizes), 0 for a kind not known. On return counts[k] holds how
 * many records of kind k there are, and offsets[] holds every record's offset grouped by kind (kind 0's
 * first, then kind 1's...), each group in buffer order; `scratch` needs room for `most` kinds. Returns the
 * number of records, or -1 when the buffer cannot be walked exactly (a kind not known, a record past
 * `valid`, more than `most` records). */
int64_t gfp_walk(const uint8_t *buf, uint64_t valid, const uint32_t *sizes, int32_t nsizes, uint32_t *offsets,
                 int32_t *scratch, int64_t most, int64_t *counts) {
    uint64_t off = 0;
    int64_t n = 0;
    if (nsizes < 1 || nsizes > GFP_MAX_KINDS) return -1;
    for (int32_t k = 0; k < nsizes; k++) counts[k] = 0;
    while (off < valid) {
        int32_t kind;
        if (off + sizeof(kind) > valid || n >= most) return -1;
        memcpy(&kind, buf + off, sizeof(kind));
        if (kind < 0 || kind >= nsizes || sizes[kind] == 0 || off + sizes[kind] > valid) return -1;
        scratch[n] = kind;
        counts[kind]++;
        n++;
        off += sizes[kind];
    }
    /* second pass: each record's offset into its kind's group (a counting sort; stable) */
    int64_t start[GFP_MAX_KINDS];
    int64_t at = 0;
    for (int32_t k = 0; k < nsizes; k++) {
        start[k] = at;
        at += counts[k];
    }
    off = 0;
    for (int64_t i = 0; i < n; i++) {
        int32_t kind = scratch[i];
        offsets[start[kind]++] = (uint32_t)off;
        off += sizes[kind];
    }
    return n;
}

/* The sender's read of a buffer it forwards to the daemon as it is, in one call that keeps the GIL (a 64 KiB
 * buffer in a few microseconds, where the walk, the gather of the MEMORY2 structs, their copy into the probe's
 * queue and the look at the API records' return values cost Python and numpy about a hundred): gfp_walk's
 * answer (offsets, counts, the return value), and in the same pass
 *   - each record of kind `copy_kind` copied back to back into `copy_out`, which has room for `copy_room` of
 *     them (sizes[copy_kind] bytes each): the probe's table queue, written in place;
 *   - summary[0]: a mask of the kinds present (bit k: kind k; every kind gfp_walk knows is below 64);
 *     summary[1]: the records of `copy_kind` copied; summary[2]: the records of the kinds in `counted_mask`
 *     (what the daemon counts); summary[3 + i], for each of the `n_api` kinds in `api_kinds`: how many of its
 *     records carry a non-zero 32-bit word at `ret_offset` (a call that did not return success). A record
 *     too short to hold that word counts as failed: the caller then reads those records itself.
 * Returns the number of records, -1 where the buffer cannot be walked exactly (as gfp_walk), -2 where the
 * records of `copy_kind` do not fit `copy_out` (then nothing is to be read from it), -3 for a kind past 63. */
/* What gfp_read answers beside the copy, for a buffer gfp_walk walked into `offsets` and `counts` (`n` records):
 * summary[0..] as gfp_read's; *copy_at the index in offsets[] of kind `copy_kind`'s group. 0, or -3 for a kind
 * past 63. */
static int read_summary(const uint8_t *buf, int64_t n, const uint32_t *sizes, int32_t nsizes, const uint32_t *offsets,
                        const int64_t *counts, int32_t copy_kind, const int32_t *api_kinds, int32_t n_api,
                        uint32_t ret_offset, uint64_t counted_mask, int64_t *summary, int64_t *copy_at) {
    (void)n;
    uint64_t kinds = 0;
    summary[1] = summary[2] = 0;
    for (int32_t i = 0; i < n_api; i++) summary[3 + i] = 0;
    *copy_at = 0;
    int64_t at = 0; /* the first offset of kind k's group (the groups follow in kind order) */
    for (int32_t k = 0; k < nsizes; k++) {
        int64_t count = counts[k];
        if (count == 0) continue;
        if (k > 63) return -3;
        kinds |= (uint64_t)1 << k;
        if (counted_mask >> k & 1) summary[2] += count;
        const uint32_t *offs = offsets + at;
        if (k == copy_kind) {
            *copy_at = at;
            summary[1] = count;
        }
        at += count;
        uint64_t size = sizes[k];
        for (int32_t a = 0; a < n_api; a++) {
            if (api_kinds[a] != k) continue;
            if ((uint64_t)ret_offset + sizeof(uint32_t) > size) {
                summary[3 + a] = count;
                break;
            }
            int64_t failed = 0;
            for (int64_t i = 0; i < count; i++) {
                uint32_t ret;
                memcpy(&ret, buf + offs[i] + ret_offset, sizeof ret);
                failed += ret != 0;
            }
            summary[3 + a] = failed;
            break;
        }
    }
    summary[0] = (int64_t)kinds;
    return 0;
}

int64_t gfp_read(const uint8_t *buf, uint64_t valid, const uint32_t *sizes, int32_t nsizes, uint32_t *offsets,
                 int32_t *scratch, int64_t most, int64_t *counts, int32_t copy_kind, uint8_t *copy_out,
                 int64_t copy_room, const int32_t *api_kinds, int32_t n_api, uint32_t ret_offset,
                 uint64_t counted_mask, int64_t *summary) {
    int64_t n = gfp_walk(buf, valid, sizes, nsizes, offsets, scratch, most, counts);
    if (n < 0) return n;
    int64_t copy_at;
    if (read_summary(buf, n, sizes, nsizes, offsets, counts, copy_kind, api_kinds, n_api, ret_offset, counted_mask,
                     summary, &copy_at) < 0)
        return -3;
    int64_t count = summary[1];
    if (count > copy_room) return -2;
    uint64_t size = count ? sizes[copy_kind] : 0;
    for (int64_t i = 0; i < count; i++) memcpy(copy_out + (uint64_t)i * size, buf + offsets[copy_at + i], size);
    return n;
}

/* A watermark's MEMORY2 structs for the probe's own live table, paired by address (the table's numpy path sorts
 * them by address and time: 2.0-3.2 ms a watermark of 56,000 records on the development VM, the GIL held for
 * most of it; this runs through a handle that lets the GIL go, in time linear in the structs). Under allocation churn
 * almost every address is allocated and released within a watermark, and only its last record decides whether
 * it stays live: the table then changes by a few entries.
 *
 * The `n` structs at `structs` are `stride` bytes apart, each with a u64 timestamp at `off_ts`, a u64 address
 * at `off_addr` and an i32 operation at `off_op`. Only those stamped at or before `cut` with the operation
 * `op_alloc` or `op_release` are looked at (the others wait for a later watermark, or are not the table's).
 * Each address's records are taken in time order, ties in queue order (numpy's stable lexsort by address and
 * time does the same): the queue is in time order per CUPTI thread buffer, not across them.
 *
 * `work` is zeroed scratch of `work_bytes` (gfp_pair_work_bytes), kept by the caller between calls and given to
 * one call at a time (nothing is allocated here but what glibc's qsort_r may take for an address to sort). Too small, nothing is done, counts[0] says how many bytes are
 * needed and -3 is returned. Out, each with room for `n`:
 *   stay[]        the index of each address's last record where it is an allocation (it stays live);
 *   first_rel[]   the addresses whose first record is a release (it ends a row the table holds, or nothing);
 *   last_rel[]    the addresses whose last record is a release (their row leaves the table);
 *   first_alloc[] the addresses whose first record is an allocation (the caller checks none is live already);
 *   counts[0..4]  how many of each, then the releases that came right after a release of the same address;
 *   counts[5..7]  the structs stamped at or before `cut`, the index of the first stamped after it (`n` if none),
 *                 and how many of those after that index are stamped at or before `cut` (0: what waits is the
 *                 queue's tail);
 *   counts[8]     the addresses whose records were not in time order in the queue (sorted here).
 * Returns 0; 1 where an address is allocated twice in a row in time order (the record-by-record rule decides;
 * of the out arrays only counts[5..8] are meant); -3 as above. Addresses come out in the order first seen. */
typedef struct {
    uint64_t addr;
    uint32_t gen; /* the call that filled it (the table is never cleared: a slot of an older call is empty) */
    int32_t id;   /* the address's number, in the order first seen */
} gfp_pair_slot;

static uint64_t pair_hash(uint64_t a) {
    a ^= a >> 33;
    a *= 0xff51afd7ed558ccdULL;
    a ^= a >> 33;
    return a;
}

#define GFP_PAIR_HEAD 64 /* the work's first bytes: the last call's generation */
/* Bytes of work for `cap` slots: the hash table, and for up to cap / 2 records and addresses their arrays. */
static uint64_t pair_bytes(uint64_t cap) {
    uint64_t half = cap / 2;
    return GFP_PAIR_HEAD + cap * sizeof(gfp_pair_slot) + half * (sizeof(uint64_t) + 2 * sizeof(int32_t))
           + half * (sizeof(uint64_t) + 3 * sizeof(int32_t) + 1);
}

static uint64_t pair_capacity(int64_t n) { /* slots for n records: a power of two, at most half full */
    uint64_t cap = 1024;
    while (cap < 2 * (uint64_t)n) cap *= 2;
    return cap;
}

/* The bytes of zeroed scratch gfp_pair needs for `n` structs (a larger one serves too). */
uint64_t gfp_pair_work_bytes(int64_t n) { return pair_bytes(pair_capacity(n)); }

typedef struct {
    const uint64_t *ts;
} pair_order;

static int pair_by_time(const void *x, const void *y, void *ctx) { /* time, then queue order */
    const uint64_t *ts = ((const pair_order *)ctx)->ts;
    int32_t a = *(const int32_t *)x, b = *(const int32_t *)y;
    if (ts[a] != ts[b]) return ts[a] < ts[b] ? -1 : 1;
    return (a > b) - (a < b);
}

int gfp_pair(const uint8_t *structs, int64_t n, int64_t stride, int64_t off_ts, int64_t off_addr,
             int64_t off_op, uint64_t cut, int32_t op_alloc, int32_t op_release, uint8_t *work,
             uint64_t work_bytes, int64_t *stay, uint64_t *first_rel, uint64_t *last_rel, uint64_t *first_alloc,
             int64_t *counts) {
    /* The layout follows from the work's size alone, so the same bytes are the hash table at every call
     * (slots of an older call are told apart by their generation, never cleared). */
    uint64_t cap = 1024;
    while (pair_bytes(2 * cap) <= work_bytes) cap *= 2;
    if (n >= INT32_MAX || pair_bytes(cap) > work_bytes || 2 * (uint64_t)n > cap) {
        counts[0] = (int64_t)gfp_pair_work_bytes(n);
        return -3;
    }
    /* Only the first slots this call needs are probed: after a burst the work (and its table) is far larger
     * than a watermark's records, and addresses spread over all of it would each miss the caches. A slot past
     * them, or of an older call, holds an older generation and reads as empty either way. */
    uint64_t mask = pair_capacity(n) - 1, half = cap / 2;
    uint32_t *last_gen = (uint32_t *)work;
    uint32_t gen = ++*last_gen;
    gfp_pair_slot *table = (gfp_pair_slot *)(work + GFP_PAIR_HEAD);
    if (gen == 0) { /* wrapped after 2^32 calls: every slot would look filled by some call; clear them once */
        memset(table, 0, cap * sizeof *table);
        gen = *last_gen = 1;
    }
    uint64_t *addr_of = (uint64_t *)(table + cap);
    int32_t *count_of = (int32_t *)(addr_of + half);
    int32_t *start_of = count_of + half;
    uint64_t *rec_ts = (uint64_t *)(start_of + half);
    int32_t *rec_id = (int32_t *)(rec_ts + half);
    int32_t *rec_idx = rec_id + half;
    int32_t *bucket = rec_idx + half;
    uint8_t *rec_alloc = (uint8_t *)(bucket + half);

    int64_t due = 0, first_waiting = n, due_after = 0, distinct = 0, k = 0;
    for (int64_t i = 0; i < n; i++) {
        const uint8_t *s = structs + (uint64_t)i * (uint64_t)stride;
        uint64_t ts, addr;
        int32_t op;
        memcpy(&ts, s + off_ts, sizeof ts);
        if (ts > cut) {
            if (first_waiting == n) first_waiting = i;
            continue;
        }
        due++;
        due_after += first_waiting < i;
        memcpy(&op, s + off_op, sizeof op);
        if (op != op_alloc && op != op_release) continue;
        memcpy(&addr, s + off_addr, sizeof addr);
        uint64_t h = pair_hash(addr) & mask;
        while (table[h].gen == gen && table[h].addr != addr) h = (h + 1) & mask;
        if (table[h].gen != gen) {
            table[h].gen = gen;
            table[h].addr = addr;
            table[h].id = (int32_t)distinct;
            addr_of[distinct] = addr;
            count_of[distinct] = 0;
            distinct++;
        }
        int32_t id = table[h].id;
        count_of[id]++;
        rec_ts[k] = ts;
        rec_id[k] = id;
        rec_idx[k] = (int32_t)i;
        rec_alloc[k] = op == op_alloc;
        k++;
    }
    counts[5] = due;
    counts[6] = first_waiting;
    counts[7] = due_after;
    /* each address's records together, in queue order (a counting sort by address number) */
    int32_t at = 0;
    for (int64_t a = 0; a < distinct; a++) {
        start_of[a] = at;
        at += count_of[a];
    }
    for (int64_t r = 0; r < k; r++) bucket[start_of[rec_id[r]]++] = (int32_t)r;
    int64_t ks = 0, kf = 0, kl = 0, ka = 0, repeated = 0, unordered = 0, begin = 0;
    for (int64_t a = 0; a < distinct; a++) {
        int32_t *b = bucket + begin;
        int64_t len = count_of[a];
        begin += len;
        int sorted = 1;
        for (int64_t j = 1; j < len && sorted; j++) sorted = rec_ts[b[j - 1]] <= rec_ts[b[j]];
        if (!sorted) { /* into time order, ties kept in queue order */
            pair_order ctx = {rec_ts};
            unordered++;
            qsort_r(b, (size_t)len, sizeof *b, pair_by_time, &ctx);
        }
        for (int64_t j = 1; j < len; j++) {
            int prev = rec_alloc[b[j - 1]], cur = rec_alloc[b[j]];
            if (prev && cur) {
                counts[8] = unordered;
                return 1;
            }
            repeated += !prev && !cur;
        }
        uint64_t addr = addr_of[a];
        if (rec_alloc[b[0]]) first_alloc[ka++] = addr;
        else first_rel[kf++] = addr;
        if (rec_alloc[b[len - 1]]) stay[ks++] = rec_idx[b[len - 1]];
        else last_rel[kl++] = addr;
    }
    counts[0] = ks;
    counts[1] = kf;
    counts[2] = kl;
    counts[3] = ka;
    counts[4] = repeated;
    counts[8] = unordered;
    return 0;
}

/* The sender thread's non-blocking calls on its socket and on its eventfd, for ctypes.PyDLL: they keep the
 * GIL. Each returns at once (MSG_DONTWAIT; the eventfd is non-blocking), and a call through Python's socket
 * or os module lets the GIL go and must win it back: behind busy Python threads up to a switch interval
 * (5 ms) a call, three such calls a wake. Each returns what it moved, or -errno. */
int64_t gfp_send(int fd, const uint8_t *buf, uint64_t len) {
    ssize_t n = send(fd, buf, (size_t)len, MSG_DONTWAIT | MSG_NOSIGNAL);
    return n < 0 ? -(int64_t)errno : (int64_t)n;
}

/* gfp_pump: for ctypes.CDLL, which lets the GIL go for the whole call: send buf[0:len) to fd, waiting for room
 * (poll) up to timeout_ms in all. The sender calls it only once the socket took all it would at once (gfp_send,
 * GIL kept), for what still waits: in Python each wait for room let the GIL go and won it back, behind busy
 * Python threads up to a switch interval each time and longer on a CPU that is not to be had, about 200 KiB
 * (what the kernel holds of a Unix socket) a wait. Returns the bytes sent (0: none, the time ran out), or
 * -errno where the socket failed before any was (after some, their count: the next call meets the error;
 * a hang-up or error poll reports is asked of one more send, so that it is -errno, not 0). */
#define GFP_PUMP_SEND_MOST (1u << 20)

static int64_t elapsed_ms(const struct timespec *since) {
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    int64_t ns = (int64_t)(now.tv_sec - since->tv_sec) * 1000000000LL + (now.tv_nsec - since->tv_nsec);
    return ns / 1000000; /* whole milliseconds gone: never ends a wait early */
}

int64_t gfp_pump(int fd, const uint8_t *buf, uint64_t len, int32_t timeout_ms) {
    struct timespec began;
    clock_gettime(CLOCK_MONOTONIC, &began);
    uint64_t sent = 0;
    int told = 0; /* poll reported a hang-up or error: the next send's answer is the last word */
    while (sent < len) {
        uint64_t chunk = len - sent < GFP_PUMP_SEND_MOST ? len - sent : GFP_PUMP_SEND_MOST;
        ssize_t n = send(fd, buf + sent, (size_t)chunk, MSG_DONTWAIT | MSG_NOSIGNAL);
        if (n > 0) {
            sent += (uint64_t)n;
            told = 0;
            continue;
        }
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK)
            return sent ? (int64_t)sent : -(int64_t)errno;
        if (n == 0 || told)
            break; /* (told: poll said the socket failed, yet send has no error to give: nothing more to wait for) */
        int64_t left = (int64_t)timeout_ms - elapsed_ms(&began);
        if (left <= 0)
            break;
        struct pollfd want = {.fd = fd, .events = POLLOUT, .revents = 0};
        int ready = poll(&want, 1, (int)(left < INT_MAX ? left : INT_MAX));
        if (ready < 0 && errno != EINTR)
            return sent ? (int64_t)sent : -(int64_t)errno;
        if (ready > 0 && (want.revents & (POLLERR | POLLHUP | POLLNVAL)) && !(want.revents & POLLOUT))
            told = 1; /* the next send says what went wrong */
    }
    return (int64_t)sent;
}

int64_t gfp_recv(int fd, uint8_t *buf, uint64_t len) {
    ssize_t n = recv(fd, buf, (size_t)len, MSG_DONTWAIT);
    return n < 0 ? -(int64_t)errno : (int64_t)n;
}

/* 1 when the eventfd was set (and is now clear), 0 when it was not. */
int gfp_eventfd_clear(int fd) {
    uint64_t value;
    return read(fd, &value, sizeof value) == (ssize_t)sizeof value;
}

/* ---- The forwarder: CUPTI's buffers to the daemon without the sender's Python ------------------------------
 *
 * With the callbacks above, the sender thread still woke for every completed buffer and, holding the GIL, read
 * it (gfp_read), framed it and put it into its socket's send buffer: about 80 us a 64 KiB buffer on the
 * development VM, about a hundred a second under cudaMallocAsync, each in whatever step the program was in.
 * A forwarder is a thread of its own, started by gfp_fwd_new on a pool: it takes the pool's completed buffers in
 * order and, while the sender says it may (gfp_fwd_set: connected to a daemon that reads CUPTI's buffers
 * unchecked, nothing of the sender's own to look at), reads each, frames it as a CUPTI_BUFFER frame (the frame's
 * first bytes are the sender's, its length patched in) into an outbox, copies its MEMORY2 structs out for the
 * probe's own table, and gives the buffer back. A buffer it may not forward (the sender's flag off, a kind the
 * daemon does not read, an API call that failed, a buffer the walk cannot read) goes to the sender as before,
 * through a ring of its own and the eventfd. The sender wakes for the outbox only once it holds `wake_bytes`
 * (or at its own cadence), swaps it for the other side (gfp_fwd_swap: two sides, the forwarder always writes
 * the one the sender does not hold), moves its frames into its socket's send buffer behind what is there and
 * its structs into the table's queue, and releases it (gfp_fwd_release). The daemon's decoding stays one: the
 * frames are the sender's own, the buffers as CUPTI wrote them.
 *
 * Order: the forwarder reads the ring in completion order. Before a watermark or a mark the sender flushes
 * CUPTI and waits (gfp_fwd_sync) until every buffer queued by then is read, so that its frames go ahead of
 * what the sender sends next. A buffer handed to the sender may reach the daemon after later buffers' frames;
 * the daemon orders records by the watermark, not by arrival.
 *
 * Locks: the pool's mutex for its ring and the sync's counters (CUPTI's callbacks take it for a few loads and
 * stores, never longer); the forwarder's own for its sides, flags and handed ring, never held while the pool's
 * is taken. */

#define GFP_FWD_INFO 12

typedef struct {
    uint8_t *out;      /* frames back to back */
    uint64_t out_len, out_cap;
    uint64_t *ledger;  /* per frame: its end in out, its records */
    int64_t n_frames, ledger_cap;
    uint8_t *structs;  /* MEMORY2 structs back to back */
    int64_t n_structs, structs_cap;
    uint64_t buffers, records, dropped_buffers, dropped_records, dropped_max_ts, cpu_ns;
    int64_t stale_frames; /* frames at the head framed for an earlier connection (gfp_fwd_set's epoch) */
    int woke;             /* the sender was woken for this side's bytes */
} gfp_side;

typedef struct gfp_fwd {
    gfp_pool *pool;
    pthread_t thread;
    pthread_cond_t work; /* with the pool's mutex: a buffer completed, or stop */
    pthread_cond_t idle; /* with the pool's mutex: `processed` moved */
    uint64_t processed;  /* buffers taken from the pool's ring and dealt with (pool's mutex) */
    int stop, in_hand;   /* pool's mutex */
    pthread_mutex_t mu;  /* everything below */
    gfp_side side[2];
    int cur, held;       /* the side the forwarder writes; the sender holds the other (held) */
    int on;
    uint64_t forward_mask, room, epoch, wake_bytes;
    gfp_done *handed;    /* buffers for the sender to read: a ring of the pool's size */
    int handed_head, n_handed;
    uint64_t forwarded, to_sender, dropped, alloc_failures;
    /* the read's configuration and scratch (the forwarder's thread only) */
    uint32_t sizes[GFP_MAX_KINDS];
    int32_t nsizes, copy_kind, n_api;
    int32_t api_kinds[16];
    uint32_t ret_offset, ts_offset;
    uint64_t counted_mask, api_mask;
    uint8_t head[64];
    int32_t head_len, len_at;
    uint32_t len_extra;
    uint32_t *offsets;
    int32_t *scratch;
    int64_t most;
    int64_t counts[GFP_MAX_KINDS];
    int64_t summary[3 + 16];
} gfp_fwd;

static void gfp_fwd_signal(struct gfp_fwd *f) { pthread_cond_signal(&f->work); }

static int grow(void **mem, uint64_t *cap, uint64_t need, uint64_t unit) {
    if (need <= *cap) return 0;
    uint64_t c = *cap ? *cap : 64;
    while (c < need) c *= 2;
    void *m = realloc(*mem, c * unit);
    if (!m) return -1;
    *mem = m;
    *cap = c;
    return 0;
}

static uint64_t thread_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return (uint64_t)t.tv_sec * 1000000000ULL + (uint64_t)t.tv_nsec;
}

/* One buffer: forwarded into the current side, or handed to the sender. Returns 1 where the sender is to be woken. */
static int fwd_one(gfp_fwd *f, uint64_t address, uint64_t valid) {
    uint64_t t0 = thread_ns();
    const uint8_t *buf = (const uint8_t *)(uintptr_t)address;
    int64_t n = gfp_walk(buf, valid, f->sizes, f->nsizes, f->offsets, f->scratch, f->most, f->counts);
    int64_t copy_at = 0, failed = 0;
    int readable = n >= 0 && read_summary(buf, n, f->sizes, f->nsizes, f->offsets, f->counts, f->copy_kind,
                                          f->api_kinds, f->n_api, f->ret_offset, f->counted_mask, f->summary,
                                          &copy_at) == 0;
    if (readable)
        for (int32_t a = 0; a < f->n_api; a++) failed += f->summary[3 + a];
    int wake = 0, forwarded = 0;
    pthread_mutex_lock(&f->mu);
    if (readable && f->on && !((uint64_t)f->summary[0] & ~f->forward_mask) && failed == 0) {
        gfp_side *s = &f->side[f->cur];
        int64_t m2 = f->summary[1];
        uint64_t size = m2 ? f->sizes[f->copy_kind] : 0;
        uint64_t records = (uint64_t)f->summary[2];
        uint64_t frame = (uint64_t)f->head_len + valid;
        uint64_t scap = (uint64_t)s->structs_cap, lcap = (uint64_t)s->ledger_cap;
        /* The structs always go to the table (it stays exact; a dropped frame's records come back by a resync):
         * where they find no memory the buffer goes to the sender instead. */
        if (grow((void **)&s->structs, &scap, (uint64_t)(s->n_structs + m2), size ? size : 1) == 0) {
            s->structs_cap = (int64_t)scap;
            forwarded = 1;
            uint64_t newest = 0;
            for (int64_t i = 0; i < m2; i++) {
                const uint8_t *rec = buf + f->offsets[copy_at + i];
                memcpy(s->structs + (uint64_t)(s->n_structs + i) * size, rec, size);
                uint64_t ts;
                memcpy(&ts, rec + f->ts_offset, sizeof ts);
                if (ts > newest) newest = ts;
            }
            s->n_structs += m2;
            s->buffers++;
            s->records += records;
            int dropped = s->out_len + frame > f->room
                          || grow((void **)&s->out, &s->out_cap, s->out_len + frame, 1) != 0
                          || grow((void **)&s->ledger, &lcap, 2 * (uint64_t)(s->n_frames + 1), sizeof(uint64_t)) != 0;
            s->ledger_cap = (int64_t)lcap;
            if (dropped) {
                s->dropped_buffers++;
                s->dropped_records += records;
                if (newest > s->dropped_max_ts) s->dropped_max_ts = newest;
                f->dropped++;
                wake = 1;
            } else {
                uint8_t *at = s->out + s->out_len;
                memcpy(at, f->head, (size_t)f->head_len);
                uint32_t length = (uint32_t)(valid + f->len_extra);
                memcpy(at + f->len_at, &length, sizeof length); /* little-endian, as the frame's header */
                memcpy(at + f->head_len, buf, (size_t)valid);
                s->out_len += frame;
                s->ledger[2 * s->n_frames] = s->out_len;
                s->ledger[2 * s->n_frames + 1] = records;
                s->n_frames++;
                f->forwarded++;
                if (s->out_len >= f->wake_bytes && !s->woke) {
                    s->woke = 1;
                    wake = 1;
                }
            }
        } else {
            f->alloc_failures++;
        }
    }
    if (!forwarded) {
        /* A failed call: the sender may want the calls after it (a success on its thread settles it), so no buffer
         * with API records is forwarded until it has read this one and says so again (gfp_fwd_set). */
        if (readable && failed) f->forward_mask &= ~f->api_mask;
        ring_push(f->handed, f->handed_head, &f->n_handed, f->pool->max_buffers, address, valid);
        f->to_sender++;
        wake = 1;
    }
    f->side[f->cur].cpu_ns += thread_ns() - t0;
    pthread_mutex_unlock(&f->mu);
    if (forwarded) gfp_give_back(f->pool, address);
    return wake;
}

static void *fwd_main(void *arg) {
    gfp_fwd *f = arg;
    gfp_pool *p = f->pool;
    pthread_mutex_lock(&p->mu);
    for (;;) {
        while (p->n_done == 0 && !f->stop) pthread_cond_wait(&f->work, &p->mu);
        if (f->stop) break;
        gfp_done d = ring_pop(p->done, &p->done_head, &p->n_done, p->max_buffers);
        f->in_hand = 1;
        pthread_mutex_unlock(&p->mu);
        int wake = fwd_one(f, d.address, d.valid);
        pthread_mutex_lock(&p->mu);
        f->in_hand = 0;
        f->processed++;
        if (wake) wake_sender(p);
        pthread_cond_broadcast(&f->idle);
    }
    pthread_mutex_unlock(&p->mu);
    return NULL;
}

/* A forwarder on pool p (its thread started; from now on it reads the pool's completed buffers, the sender takes
 * only those it hands over: gfp_fwd_take). The read's configuration is gfp_read's (sizes, the kind whose structs
 * are copied out, the API kinds whose return values are looked at, the kinds the daemon counts) and the offset of
 * a copied struct's u64 timestamp; `head` the first `head_len` bytes of every frame, a u32 at `len_at` set to the
 * buffer's bytes plus `len_extra`. NULL where it cannot start (no memory, no thread, one already attached). */
gfp_fwd *gfp_fwd_new(gfp_pool *p, const uint32_t *sizes, int32_t nsizes, int32_t copy_kind, const int32_t *api_kinds,
                     int32_t n_api, uint32_t ret_offset, uint64_t counted_mask, uint32_t ts_offset, const uint8_t *head,
                     int32_t head_len, int32_t len_at, uint32_t len_extra, uint64_t wake_bytes) {
    if (nsizes < 1 || nsizes > GFP_MAX_KINDS || copy_kind < 0 || copy_kind >= nsizes || n_api < 0 || n_api > 16
        || head_len < 4 || head_len > 64 || len_at < 0 || len_at + 4 > head_len || sizes[copy_kind] < ts_offset + 8)
        return NULL;
    gfp_fwd *f = calloc(1, sizeof(*f));
    if (!f) return NULL;
    f->pool = p;
    memcpy(f->sizes, sizes, (size_t)nsizes * sizeof(uint32_t));
    f->nsizes = nsizes;
    f->copy_kind = copy_kind;
    memcpy(f->api_kinds, api_kinds, (size_t)n_api * sizeof(int32_t));
    f->n_api = n_api;
    for (int32_t a = 0; a < n_api; a++)
        if (api_kinds[a] >= 0 && api_kinds[a] < 64) f->api_mask |= (uint64_t)1 << api_kinds[a];
    f->ret_offset = ret_offset;
    f->counted_mask = counted_mask;
    f->ts_offset = ts_offset;
    memcpy(f->head, head, (size_t)head_len);
    f->head_len = head_len;
    f->len_at = len_at;
    f->len_extra = len_extra;
    f->wake_bytes = wake_bytes;
    uint32_t smallest = UINT32_MAX;
    for (int32_t k = 0; k < nsizes; k++)
        if (sizes[k] && sizes[k] < smallest) smallest = sizes[k];
    f->most = (int64_t)(p->buffer_bytes / (smallest ? smallest : 1)) + 1;
    f->offsets = malloc((size_t)f->most * sizeof(uint32_t));
    f->scratch = malloc((size_t)f->most * sizeof(int32_t));
    f->handed = calloc((size_t)p->max_buffers, sizeof(gfp_done));
    int mu = pthread_mutex_init(&f->mu, NULL) == 0;
    int work = mu && pthread_cond_init(&f->work, NULL) == 0;
    /* the sync's wait runs on the monotonic clock: a step of the wall clock must not stretch or cut it */
    pthread_condattr_t attr;
    int idle = 0;
    if (work && pthread_condattr_init(&attr) == 0) {
        idle = pthread_condattr_setclock(&attr, CLOCK_MONOTONIC) == 0 && pthread_cond_init(&f->idle, &attr) == 0;
        pthread_condattr_destroy(&attr);
    }
    int ok = f->offsets && f->scratch && f->handed && idle;
    if (ok) {
        pthread_mutex_lock(&p->mu);
        ok = p->fwd == NULL;
        if (ok) {
            p->fwd = f; /* claimed: from now on completed() signals this forwarder, whose thread reads the ring */
            /* buffers the sender took before are none of the forwarder's: only those in the ring now are */
            f->processed = p->queued - (uint64_t)p->n_done;
        }
        pthread_mutex_unlock(&p->mu);
    }
    if (ok) {
        /* outside the pool's mutex (CUPTI's callbacks take it); the thread reads the ring from its oldest buffer
         * once it runs, and CUPTI's threads and the sender are not held up by signals it does not handle */
        sigset_t all, old;
        sigfillset(&all);
        pthread_sigmask(SIG_SETMASK, &all, &old);
        ok = pthread_create(&f->thread, NULL, fwd_main, f) == 0;
        pthread_sigmask(SIG_SETMASK, &old, NULL);
        if (ok) {
            pthread_setname_np(f->thread, "gfp-forwarder"); /* in top -H, apart from the sender it came from */
        } else {
            pthread_mutex_lock(&p->mu);
            p->fwd = NULL;
            if (p->n_done) wake_sender(p); /* what completed meanwhile is the sender's again */
            pthread_mutex_unlock(&p->mu);
        }
    }
    if (!ok) {
        if (idle) pthread_cond_destroy(&f->idle);
        if (work) pthread_cond_destroy(&f->work);
        if (mu) pthread_mutex_destroy(&f->mu);
        free(f->offsets); free(f->scratch); free(f->handed); free(f);
        return NULL;
    }
    return f;
}

/* The sender's word, at each of its wakes: forward (`on`) the buffers whose kinds are all in `forward_mask` (without
 * the API kinds while it reads their records: a launch window, a failed call waiting to be judged), into
 * a side of at most `room` bytes of frames (what its send buffer has room for). A new `epoch` (a new connection)
 * makes the frames framed so far stale: the sender drops them (their records reach the new daemon by its resync). */
void gfp_fwd_set(gfp_fwd *f, int32_t on, uint64_t forward_mask, uint64_t room, uint64_t epoch) {
    pthread_mutex_lock(&f->mu);
    f->on = on != 0;
    /* API records stay the sender's while buffers it handed over wait to be taken: one of them may be a failed
     * call that the sender, once it has read it, wants the calls after (it reads every buffer it takes before it
     * sets again). */
    f->forward_mask = f->n_handed ? forward_mask & ~f->api_mask : forward_mask;
    f->room = room;
    if (epoch != f->epoch) {
        f->epoch = epoch;
        f->side[f->cur].stale_frames = f->side[f->cur].n_frames;
    }
    pthread_mutex_unlock(&f->mu);
}

/* Buffers queued in the pool and not yet dealt with by the forwarder (for ctypes.PyDLL: returns at once). */
int64_t gfp_fwd_lag(gfp_fwd *f) {
    pthread_mutex_lock(&f->pool->mu);
    int64_t lag = (int64_t)(f->pool->queued - f->processed);
    pthread_mutex_unlock(&f->pool->mu);
    return lag;
}

/* For ctypes.CDLL (the GIL let go): wait up to timeout_ms until every buffer queued before this call is dealt
 * with (forwarded into the current side, or handed to the sender). Returns how many of those are not (0: done). */
int64_t gfp_fwd_sync(gfp_fwd *f, int32_t timeout_ms) {
    gfp_pool *p = f->pool;
    struct timespec until;
    clock_gettime(CLOCK_MONOTONIC, &until);
    until.tv_sec += timeout_ms / 1000;
    until.tv_nsec += (long)(timeout_ms % 1000) * 1000000L;
    if (until.tv_nsec >= 1000000000L) {
        until.tv_sec++;
        until.tv_nsec -= 1000000000L;
    }
    pthread_mutex_lock(&p->mu);
    uint64_t target = p->queued;
    while (f->processed < target && !f->stop)
        if (pthread_cond_timedwait(&f->idle, &p->mu, &until) == ETIMEDOUT) break;
    int64_t left = f->processed < target ? (int64_t)(target - f->processed) : 0;
    pthread_mutex_unlock(&p->mu);
    return left;
}

/* The sender takes the side the forwarder wrote (and the forwarder goes on in the other): info[] = out address,
 * out bytes, ledger address, frames, structs address, structs, buffers, records, dropped buffers, dropped records,
 * the newest dropped struct's timestamp, stale frames (the first of the frames). Returns 0; 1 where the side holds
 * nothing (nothing swapped); -1 where the sender still holds the other side (gfp_fwd_release first). */
int gfp_fwd_swap(gfp_fwd *f, uint64_t *info, int n) {
    pthread_mutex_lock(&f->mu);
    if (f->held) {
        pthread_mutex_unlock(&f->mu);
        return -1;
    }
    gfp_side *s = &f->side[f->cur];
    if (!s->buffers && !s->stale_frames) {
        pthread_mutex_unlock(&f->mu);
        return 1;
    }
    uint64_t v[GFP_FWD_INFO] = {(uint64_t)(uintptr_t)s->out, s->out_len, (uint64_t)(uintptr_t)s->ledger,
                                (uint64_t)s->n_frames, (uint64_t)(uintptr_t)s->structs, (uint64_t)s->n_structs,
                                s->buffers, s->records, s->dropped_buffers, s->dropped_records, s->dropped_max_ts,
                                (uint64_t)s->stale_frames};
    f->cur ^= 1;
    f->held = 1;
    pthread_mutex_unlock(&f->mu);
    if (n > GFP_FWD_INFO) n = GFP_FWD_INFO;
    memcpy(info, v, (size_t)n * sizeof(uint64_t));
    return 0;
}

/* The sender is done with the side it took: emptied (its memory kept) for the forwarder's next turn. */
/* A side's array that held less than a quarter of itself this turn goes back past 1 MiB (it grows again when a burst
 * needs it): a burst's memory is not kept in the workload's process for good. */
static void shrink(void **mem, uint64_t *cap, uint64_t used, uint64_t unit) {
    if (*cap * unit > (1u << 20) && used < *cap / 4) {
        free(*mem);
        *mem = NULL;
        *cap = 0;
    }
}

static uint64_t side_bytes(const gfp_side *s, uint64_t struct_size) {
    return s->out_cap + (uint64_t)s->ledger_cap * sizeof(uint64_t) + (uint64_t)s->structs_cap * struct_size;
}

void gfp_fwd_release(gfp_fwd *f) {
    pthread_mutex_lock(&f->mu);
    if (f->held) {
        gfp_side *s = &f->side[f->cur ^ 1];
        uint64_t lcap = (uint64_t)s->ledger_cap, scap = (uint64_t)s->structs_cap;
        shrink((void **)&s->out, &s->out_cap, s->out_len, 1);
        shrink((void **)&s->ledger, &lcap, 2 * (uint64_t)s->n_frames, sizeof(uint64_t));
        shrink((void **)&s->structs, &scap, (uint64_t)s->n_structs, f->sizes[f->copy_kind]);
        s->ledger_cap = (int64_t)lcap;
        s->structs_cap = (int64_t)scap;
        s->out_len = 0;
        s->n_frames = s->n_structs = s->stale_frames = 0;
        s->buffers = s->records = s->dropped_buffers = s->dropped_records = s->dropped_max_ts = 0;
        s->woke = 0;
        f->held = 0;
    }
    pthread_mutex_unlock(&f->mu);
}

/* Up to `most` buffers handed to the sender, oldest first, as gfp_take's. */
int gfp_fwd_take(gfp_fwd *f, uint64_t *out, int most) {
    pthread_mutex_lock(&f->mu);
    int n = ring_take(f->handed, &f->handed_head, &f->n_handed, f->pool->max_buffers, out, most);
    pthread_mutex_unlock(&f->mu);
    return n;
}

/* Counters: forwarded, to the sender, dropped, memory not had, the forwarder's CPU time (ns), handed and not yet
 * taken, queued in the pool and not yet dealt with, the bytes its two sides hold. */
#define GFP_FWD_STATS 8
int gfp_fwd_stats(gfp_fwd *f, uint64_t *out, int n) {
    uint64_t v[GFP_FWD_STATS];
    uint64_t lag = (uint64_t)gfp_fwd_lag(f);
    pthread_mutex_lock(&f->mu);
    v[0] = f->forwarded; v[1] = f->to_sender; v[2] = f->dropped; v[3] = f->alloc_failures;
    v[4] = f->side[0].cpu_ns + f->side[1].cpu_ns; v[5] = (uint64_t)f->n_handed; v[6] = lag;
    v[7] = side_bytes(&f->side[0], f->sizes[f->copy_kind]) + side_bytes(&f->side[1], f->sizes[f->copy_kind]);
    pthread_mutex_unlock(&f->mu);
    if (n > GFP_FWD_STATS) n = GFP_FWD_STATS;
    memcpy(out, v, (size_t)n * sizeof(uint64_t));
    return GFP_FWD_STATS;
}

/* For ctypes.CDLL: the forwarder's thread stops (once done with the buffer in hand) and the pool goes back to
 * waking the sender for every buffer; buffers still in its ring are the sender's (gfp_take), as are those handed
 * and not yet taken (gfp_fwd_take still answers) and a side not yet swapped (gfp_fwd_swap still answers). */
void gfp_fwd_stop(gfp_fwd *f) {
    gfp_pool *p = f->pool;
    pthread_mutex_lock(&p->mu);
    if (f->stop) {
        pthread_mutex_unlock(&p->mu);
        return;
    }
    f->stop = 1;
    pthread_cond_signal(&f->work);
    pthread_cond_broadcast(&f->idle);
    pthread_mutex_unlock(&p->mu);
    pthread_join(f->thread, NULL);
    pthread_mutex_lock(&p->mu);
    p->fwd = NULL;
    if (p->n_done) wake_sender(p);
    pthread_mutex_unlock(&p->mu);
}

/* After gfp_fwd_stop, the sender done with its sides: the forwarder's memory freed (f must not be used after). */
void gfp_fwd_free(gfp_fwd *f) {
    if (!f || !f->stop) return;
    for (int i = 0; i < 2; i++) {
        free(f->side[i].out);
        free(f->side[i].ledger);
        free(f->side[i].structs);
    }
    pthread_cond_destroy(&f->work);
    pthread_cond_destroy(&f->idle);
    pthread_mutex_destroy(&f->mu);
    free(f->offsets); free(f->scratch); free(f->handed); free(f);
}
