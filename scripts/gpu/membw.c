// What the host's memory does for the kernels the shared-memory collectives are made of:
// read, write, copy (memcpy), and write and copy with non-temporal (streaming) stores, by 1 to
// N threads at once, each on its own buffer of a given size; and in place ("rmw": each line
// read, then written back where it was, with ordinary or streaming stores), the least memory
// traffic of an in-place all-reduce, where every byte of every rank's tensor is read once and
// written once. Prints GB/s of the kernel's
// bytes (a copy of S bytes counts S, as the --memory-bound column of the benchmark does),
// summed over threads, best of 5 rounds.
//
//   cc -O2 -mavx2 -pthread scripts/gpu/membw.c -o /tmp/membw && /tmp/membw [MiB per thread ...]
#include <immintrin.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

enum kernel { READ, WRITE, WRITE_NT, COPY, COPY_NT, RMW, RMW_NT, KERNELS };
static const char *names[KERNELS] = {"read", "write", "write-nt", "copy", "copy-nt", "rmw", "rmw-nt"};

struct job {
  pthread_barrier_t *start, *end;
  enum kernel k;
  size_t bytes;
  char *src, *dst;
  volatile uint64_t sink;
  double t0, t1;  // when this thread's kernel started and ended
};

static void run_kernel(struct job *j) {
  size_t n = j->bytes / 32;
  __m256i *s = (__m256i *)j->src, *d = (__m256i *)j->dst;
  switch (j->k) {
    case READ: {
      __m256i acc = _mm256_setzero_si256();
      for (size_t i = 0; i < n; i++) acc = _mm256_xor_si256(acc, _mm256_load_si256(s + i));
      j->sink = (uint64_t)_mm256_extract_epi64(acc, 0);
      break;
    }
    case WRITE: {
      __m256i v = _mm256_set1_epi32(7);
      for (size_t i = 0; i < n; i++) _mm256_store_si256(d + i, v);
      break;
    }
    case WRITE_NT: {
      __m256i v = _mm256_set1_epi32(7);
      for (size_t i = 0; i < n; i++) _mm256_stream_si256(d + i, v);
      _mm_sfence();
      break;
    }
    case COPY: memcpy(j->dst, j->src, j->bytes); break;
    case COPY_NT:
      for (size_t i = 0; i < n; i++) _mm256_stream_si256(d + i, _mm256_load_si256(s + i));
      _mm_sfence();
      break;
    case RMW: {
      __m256i one = _mm256_set1_epi32(1);
      for (size_t i = 0; i < n; i++) _mm256_store_si256(s + i, _mm256_add_epi32(_mm256_load_si256(s + i), one));
      break;
    }
    case RMW_NT: {
      __m256i one = _mm256_set1_epi32(1);
      for (size_t i = 0; i < n; i++) _mm256_stream_si256(s + i, _mm256_add_epi32(_mm256_load_si256(s + i), one));
      _mm_sfence();
      break;
    }
    default: break;
  }
}

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

static void *worker(void *arg) {
  struct job *j = arg;
  for (;;) {
    pthread_barrier_wait(j->start);
    if (j->k == KERNELS) return NULL;
    j->t0 = now();
    run_kernel(j);
    j->t1 = now();
    pthread_barrier_wait(j->end);
  }
}

int main(int argc, char **argv) {
  long cores = sysconf(_SC_NPROCESSORS_ONLN);
  int thread_counts[] = {1, 2, 4, 8, 12, 16};
  size_t sizes_mib[8] = {4, 64};
  int nsizes = 2;
  if (argc > 1) {
    nsizes = 0;
    for (int i = 1; i < argc && nsizes < 8; i++) sizes_mib[nsizes++] = (size_t)atol(argv[i]);
  }
  printf("cores %ld; GB/s summed over threads (a copy of S bytes counts S), best of 5\n", cores);
  printf("%8s %8s", "MiB/thr", "threads");
  for (int k = 0; k < KERNELS; k++) printf(" %9s", names[k]);
  printf("\n");
  for (int si = 0; si < nsizes; si++) {
    size_t bytes = sizes_mib[si] << 20;
    for (unsigned ti = 0; ti < sizeof thread_counts / sizeof *thread_counts; ti++) {
      int t = thread_counts[ti];
      if (t > cores) continue;
      pthread_barrier_t start, end;
      pthread_barrier_init(&start, NULL, t + 1);
      pthread_barrier_init(&end, NULL, t + 1);
      struct job *jobs = calloc(t, sizeof *jobs);
      pthread_t *th = calloc(t, sizeof *th);
      for (int i = 0; i < t; i++) {
        jobs[i] = (struct job){.start = &start, .end = &end, .bytes = bytes};
        if (posix_memalign((void **)&jobs[i].src, 4096, bytes) || posix_memalign((void **)&jobs[i].dst, 4096, bytes)) return 1;
        memset(jobs[i].src, 1, bytes);  // touch every page before timing
        memset(jobs[i].dst, 2, bytes);
        pthread_create(&th[i], NULL, worker, &jobs[i]);
      }
      printf("%8zu %8d", sizes_mib[si], t);
      for (int k = 0; k < KERNELS; k++) {
        double best = 1e30;
        for (int rep = 0; rep < 5; rep++) {
          for (int i = 0; i < t; i++) jobs[i].k = (enum kernel)k;
          pthread_barrier_wait(&start);
          pthread_barrier_wait(&end);
          // From the first thread's start to the last one's end, as the threads saw them.
          double first = jobs[0].t0, last = jobs[0].t1;
          for (int i = 1; i < t; i++) {
            if (jobs[i].t0 < first) first = jobs[i].t0;
            if (jobs[i].t1 > last) last = jobs[i].t1;
          }
          double dt = last - first;
          if (dt < best) best = dt;
        }
        printf(" %9.1f", (double)bytes * t / best / 1e9);
      }
      printf("\n");
      fflush(stdout);
      for (int i = 0; i < t; i++) jobs[i].k = KERNELS;
      pthread_barrier_wait(&start);
      for (int i = 0; i < t; i++) {
        pthread_join(th[i], NULL);
        free(jobs[i].src);
        free(jobs[i].dst);
      }
      free(jobs);
      free(th);
    }
  }
  return 0;
}
