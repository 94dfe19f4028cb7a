/* Round trip of one cache line between CPU 0 and CPU 1: where the machine placed its two cores.
 *
 *     cc -O2 -pthread benchmarks/core_to_core.c -o core_to_core && ./core_to_core
 *     mpiexec -n 2 python benchmarks/placement.py --core-to-core ./core_to_core
 *
 * Two threads, pinned to CPU 0 and CPU 1, hand a flag back and forth; prints the mean
 * round trip in nanoseconds. Cores that share a cache hand it over in tens of
 * nanoseconds; cores that do not take several times as long. On a virtual machine the
 * hypervisor decides, and may change its mind while a job runs (docs/benchmarks.md).
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static _Atomic int flag __attribute__((aligned(64)));
static int rounds = 300000;

static void pin(int cpu) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    pthread_setaffinity_np(pthread_self(), sizeof set, &set);
}

static void *answer(void *unused) {
    (void)unused;
    pin(1);
    for (int i = 0; i < rounds; i++) {
        while (atomic_load_explicit(&flag, memory_order_acquire) != 1) {
        }
        atomic_store_explicit(&flag, 0, memory_order_release);
    }
    return NULL;
}

int main(int argc, char **argv) {
    if (argc > 1)
        rounds = atoi(argv[1]);
    pthread_t peer;
    pthread_create(&peer, NULL, answer, NULL);
    pin(0);
    struct timespec start, end;
    clock_gettime(CLOCK_MONOTONIC, &start);
    for (int i = 0; i < rounds; i++) {
        atomic_store_explicit(&flag, 1, memory_order_release);
        while (atomic_load_explicit(&flag, memory_order_acquire) != 0) {
        }
    }
    clock_gettime(CLOCK_MONOTONIC, &end);
    pthread_join(peer, NULL);
    printf("%.0f\n", ((end.tv_sec - start.tv_sec) * 1e9 + (end.tv_nsec - start.tv_nsec)) / rounds);
    return 0;
}
