/* A wall-clock step for one process, as an NTP step or an operator's `date -s` would make it.
 *
 * Loaded with LD_PRELOAD. The process's CLOCK_REALTIME (clock_gettime, gettimeofday, time)
 * is shifted by the signed number of nanoseconds in the file named by MQSTORE_WALLCLOCK_FILE,
 * read again at most every 20 ms of monotonic time; the monotonic and boot clocks are left
 * alone, as a real step leaves them. A missing or unreadable file means no shift.
 *
 * Built by tests/integration/wallclock.py: cc -shared -fPIC -O2 -o wallclock.so wallclock_shim.c -ldl
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

#define REREAD_NS 20000000LL

typedef int (*clock_gettime_fn)(clockid_t, struct timespec *);

static clock_gettime_fn real_clock_gettime;
static _Atomic long long offset_ns;
static _Atomic long long next_read_ns = -1;

static long long mono_ns(void) {
    struct timespec ts;
    real_clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static void init(void) {
    if (!real_clock_gettime)
        real_clock_gettime = (clock_gettime_fn)dlsym(RTLD_NEXT, "clock_gettime");
}

static long long current_offset(void) {
    long long now = mono_ns();
    if (now < atomic_load(&next_read_ns))
        return atomic_load(&offset_ns);
    atomic_store(&next_read_ns, now + REREAD_NS);
    const char *path = getenv("MQSTORE_WALLCLOCK_FILE");
    long long value = 0;
    if (path) {
        int fd = open(path, O_RDONLY | O_CLOEXEC);
        if (fd >= 0) {
            char buf[32];
            ssize_t n = read(fd, buf, sizeof buf - 1);
            close(fd);
            if (n > 0) {
                buf[n] = 0;
                value = strtoll(buf, NULL, 10);
            }
        }
    }
    atomic_store(&offset_ns, value);
    return value;
}

static void shift(struct timespec *ts) {
    long long t = (long long)ts->tv_sec * 1000000000LL + ts->tv_nsec + current_offset();
    ts->tv_sec = t / 1000000000LL;
    ts->tv_nsec = t % 1000000000LL;
    if (ts->tv_nsec < 0) {
        ts->tv_nsec += 1000000000LL;
        ts->tv_sec -= 1;
    }
}

int clock_gettime(clockid_t clk, struct timespec *ts) {
    init();
    int rc = real_clock_gettime(clk, ts);
    if (rc == 0 && (clk == CLOCK_REALTIME || clk == CLOCK_REALTIME_COARSE))
        shift(ts);
    return rc;
}

int gettimeofday(struct timeval *restrict tv, void *restrict tz) {
    (void)tz;
    struct timespec ts;
    int rc = clock_gettime(CLOCK_REALTIME, &ts);
    if (rc == 0 && tv) {
        tv->tv_sec = ts.tv_sec;
        tv->tv_usec = ts.tv_nsec / 1000;
    }
    return rc;
}

time_t time(time_t *out) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    if (out)
        *out = ts.tv_sec;
    return ts.tv_sec;
}
