/*
 * Test shim: C threads that call CUPTI buffer callbacks the way CUPTI does, with no Python of their
 * own. Built by tests/unit/test_probe_native.py with the system's C compiler.
 *
 * run_threads: `threads` pthreads each make `rounds` request/complete cycles, writing (thread, round)
 * into each buffer they get; the caller holds the GIL or not, as it chose (ctypes.PyDLL or CDLL).
 * call_under_loader_lock: calls `req` once from inside dl_iterate_phdr's callback, i.e. holding glibc's
 * loader lock (standing in for a framework's allocator mutex), after a pause in which another thread
 * may come to wait for that lock.
 * stream_bursts: CUPTI's period thread under churn (below).
 */
#define _GNU_SOURCE
#include <link.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

typedef void (*req_fn)(uint8_t **, size_t *, size_t *);
typedef void (*cmp_fn)(void *, uint32_t, uint8_t *, size_t, size_t);

struct job {
    req_fn req;
    cmp_fn cmp;
    int thread;
    int rounds;
    int refused;
};

static void *worker(void *arg) {
    struct job *j = arg;
    for (int r = 0; r < j->rounds; r++) {
        uint8_t *buf = NULL;
        size_t size = 0, most = 0;
        j->req(&buf, &size, &most);
        if (!buf || size < 16) {
            j->refused++;  /* CUPTI drops the records; here the thread pauses so the sender frees some */
            usleep(20);
            continue;
        }
        uint64_t sig[2] = {(uint64_t)j->thread, (uint64_t)r};
        memcpy(buf, sig, sizeof(sig));
        j->cmp((void *)(uintptr_t)(0x1000 + j->thread % 3), (uint32_t)(j->thread % 2), buf, size, sizeof(sig));
    }
    return NULL;
}

/* Returns the requests refused in all (no buffer), or -1 if a thread could not start. */
int run_threads(req_fn req, cmp_fn cmp, int threads, int rounds) {
    pthread_t tid[64];
    struct job jobs[64];
    if (threads > 64) threads = 64;
    int started = 0, refused = 0;
    for (int t = 0; t < threads; t++) {
        jobs[t] = (struct job){req, cmp, t, rounds, 0};
        if (pthread_create(&tid[t], NULL, worker, &jobs[t]) != 0) break;
        started++;
    }
    for (int t = 0; t < started; t++) {
        pthread_join(tid[t], NULL);
        refused += jobs[t].refused;
    }
    return started == threads ? refused : -1;
}

struct under_lock {
    req_fn req;
    int pause_ms;
    int called;
};

static int visit(struct dl_phdr_info *info, size_t size, void *data) {
    (void)info;
    (void)size;
    struct under_lock *u = data;
    usleep((useconds_t)u->pause_ms * 1000);
    uint8_t *buf = NULL;
    size_t n = 0, most = 0;
    u->req(&buf, &n, &most);
    u->called = 1;
    return 1; /* the first object ends the walk */
}

int call_under_loader_lock(req_fn req, int pause_ms) {
    struct under_lock u = {req, pause_ms, 0};
    dl_iterate_phdr(visit, &u);
    return u.called;
}

/* stream_bursts: CUPTI's period thread under churn, in C (no GIL): `bursts` times, every `burst_us`, ask
 * for `per_burst` buffers, fill each with `template` (whole records of `record_size` bytes), stamp record i
 * of the burst's buffer with CLOCK_REALTIME's now + i at `ts_offset` (so that every buffer's records come
 * after the one before's), and complete it. Returns the buffers refused (none to be had). */

int stream_bursts(req_fn req, cmp_fn cmp, const uint8_t *template, size_t template_len, size_t record_size,
                  size_t ts_offset, int per_burst, int bursts, int burst_us) {
    int refused = 0;
    struct timespec next;
    clock_gettime(CLOCK_MONOTONIC, &next);
    for (int b = 0; b < bursts; b++) {
        for (int k = 0; k < per_burst; k++) {
            uint8_t *buf = NULL;
            size_t size = 0, most = 0;
            req(&buf, &size, &most);
            if (!buf || size < template_len) {
                refused++;
                continue;
            }
            memcpy(buf, template, template_len);
            struct timespec now;
            clock_gettime(CLOCK_REALTIME, &now);
            uint64_t t = (uint64_t)now.tv_sec * 1000000000ull + (uint64_t)now.tv_nsec;
            for (size_t off = 0, i = 0; off + record_size <= template_len; off += record_size, i++) {
                uint64_t ts = t + i;
                memcpy(buf + off + ts_offset, &ts, sizeof(ts));
            }
            cmp(NULL, 0, buf, size, template_len);
        }
        next.tv_nsec += (long)burst_us * 1000;
        while (next.tv_nsec >= 1000000000L) {
            next.tv_nsec -= 1000000000L;
            next.tv_sec++;
        }
        clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &next, NULL);
    }
    return refused;
}
