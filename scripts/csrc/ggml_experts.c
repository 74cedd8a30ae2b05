// llama.cpp's CPU experts (ggml's MUL_MAT_ID gate and up, SWIGLU, MUL_MAT_ID down) for one token's
// `k` selections of `experts` stacked experts: what scripts/time_cpu_vs_ggml.py compares our fused
// CPU kernel with. Weights are random blocks (small finite scales), the pool larger than any cache;
// each call picks k distinct experts at random. ggml's persistent thread pool, as llama.cpp uses it.
//
//   ggml_experts FORMAT(bf16|q8_0|q2_k|q3_k|q4_k|q5_k|iq4_xs|mxfp4) EXPERTS THREADS CALLS HIDDEN FFN K
// prints one JSON line: {"format", "threads", "median_s", "bytes_per_call"}.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ggml-cpu.h"
#include "ggml.h"

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + 1e-9 * t.tv_nsec;
}
static int by_value(const void* a, const void* b) {
  const double x = *(const double*)a, y = *(const double*)b;
  return (x > y) - (x < y);
}
// random bytes; float16 scales of about 1e-3 where the format has them, bf16 values of about 1
static void fill(struct ggml_tensor* t) {
  uint8_t* p = t->data;
  const size_t n = ggml_nbytes(t);
  for (size_t i = 0; i < n; ++i) p[i] = rand() & 255;
  if (t->type == GGML_TYPE_Q4_K || t->type == GGML_TYPE_Q5_K) {
    const size_t size = t->type == GGML_TYPE_Q4_K ? 144 : 176;
    for (size_t i = 0; i < n; i += size) p[i] = 0, p[i + 1] = 0x14, p[i + 2] = 0, p[i + 3] = 0x14;
  } else if (t->type == GGML_TYPE_Q2_K) {
    for (size_t i = 0; i < n; i += 84) p[i + 80] = 0, p[i + 81] = 0x14, p[i + 82] = 0, p[i + 83] = 0x14;
  } else if (t->type == GGML_TYPE_Q3_K) {
    for (size_t i = 0; i < n; i += 110) p[i + 108] = 0, p[i + 109] = 0x14;
  } else if (t->type == GGML_TYPE_IQ4_XS) {
    for (size_t i = 0; i < n; i += 136) p[i] = 0, p[i + 1] = 0x14;
  } else if (t->type == GGML_TYPE_MXFP4) {
    for (size_t i = 0; i < n; i += 17) p[i] = 128 - 9;  // scales 2^-9
  } else if (t->type == GGML_TYPE_Q8_0) {
    for (size_t i = 0; i < n; i += 34) p[i] = 0, p[i + 1] = 0x14;
  } else if (t->type == GGML_TYPE_BF16) {
    uint16_t* h = t->data;
    for (size_t i = 0; i < n / 2; ++i) h[i] = 0x3c00 | (rand() & 0x1ff) | ((rand() & 1) << 15);
  }
}

int main(int argc, char** argv) {
  if (argc != 8) {
    fprintf(stderr, "usage: %s FORMAT EXPERTS THREADS CALLS HIDDEN FFN K\n", argv[0]);
    return 2;
  }
  const char* fmt = argv[1];
  const int E = atoi(argv[2]), threads = atoi(argv[3]), calls = atoi(argv[4]);
  const int H = atoi(argv[5]), I = atoi(argv[6]), K = atoi(argv[7]);
  enum ggml_type ty;
  if (!strcmp(fmt, "q8_0")) ty = GGML_TYPE_Q8_0;
  else if (!strcmp(fmt, "bf16")) ty = GGML_TYPE_BF16;
  else if (!strcmp(fmt, "q4_k")) ty = GGML_TYPE_Q4_K;
  else if (!strcmp(fmt, "q5_k")) ty = GGML_TYPE_Q5_K;
  else if (!strcmp(fmt, "q2_k")) ty = GGML_TYPE_Q2_K;
  else if (!strcmp(fmt, "q3_k")) ty = GGML_TYPE_Q3_K;
  else if (!strcmp(fmt, "iq4_xs")) ty = GGML_TYPE_IQ4_XS;
  else if (!strcmp(fmt, "mxfp4")) ty = GGML_TYPE_MXFP4;
  else { fprintf(stderr, "unknown format %s\n", fmt); return 2; }
  if (K > E || calls < 10) { fprintf(stderr, "need K <= EXPERTS and CALLS >= 10\n"); return 2; }
  struct ggml_init_params ip = {(size_t)E * 3 * H * I * 2 + ((size_t)64 << 20), NULL, false};
  struct ggml_context* ctx = ggml_init(ip);
  struct ggml_tensor* gate = ggml_new_tensor_3d(ctx, ty, H, I, E);
  struct ggml_tensor* up = ggml_new_tensor_3d(ctx, ty, H, I, E);
  struct ggml_tensor* down = ggml_new_tensor_3d(ctx, ty, I, H, E);
  fill(gate), fill(up), fill(down);
  struct ggml_tensor* x = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, H, 1, 1);
  struct ggml_tensor* ids = ggml_new_tensor_2d(ctx, GGML_TYPE_I32, K, 1);
  struct ggml_tensor* act = ggml_swiglu_split(ctx, ggml_mul_mat_id(ctx, gate, x, ids), ggml_mul_mat_id(ctx, up, x, ids));
  struct ggml_tensor* out = ggml_mul_mat_id(ctx, down, act, ids);
  struct ggml_cgraph* graph = ggml_new_graph(ctx);
  ggml_build_forward_expand(graph, out);
  float* xv = x->data;
  for (int i = 0; i < H; ++i) xv[i] = rand() / (float)RAND_MAX - 0.5f;
  struct ggml_threadpool_params tpp = ggml_threadpool_params_default(threads);
  struct ggml_threadpool* pool = ggml_threadpool_new(&tpp);
  struct ggml_cplan plan = ggml_graph_plan(graph, threads, pool);
  plan.work_data = malloc(plan.work_size ? plan.work_size : 1);
  double* took = malloc(sizeof(double) * calls);
  for (int c = 0; c < calls; ++c) {
    int32_t* iv = ids->data;
    for (int j = 0; j < K; ++j) {
      int again = 1;
      while (again) {
        iv[j] = rand() % E, again = 0;
        for (int i = 0; i < j; ++i) again |= iv[i] == iv[j];
      }
    }
    const double t0 = now();
    ggml_graph_compute(graph, &plan);
    took[c] = now() - t0;
  }
  const int warm = calls / 10;
  qsort(took + warm, calls - warm, sizeof(double), by_value);
  const double bytes = (double)K * (ggml_nbytes(gate) + ggml_nbytes(up) + ggml_nbytes(down)) / E;
  printf("{\"format\": \"%s\", \"threads\": %d, \"median_s\": %.9f, \"bytes_per_call\": %.0f}\n", fmt, threads,
         took[warm + (calls - warm) / 2], bytes);
  ggml_threadpool_free(pool);
  return 0;
}
