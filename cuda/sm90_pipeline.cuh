// The sm90 kernels' pipelines: STAGES-deep rings of shared-memory buffers, each stage with a "full"
// mbarrier (the producer's copies landed) and an "empty" one (the consumers are done with it).
#pragma once
#include "sm90_primitives.cuh"

// Position in a ring: the stage to use next and the parity of the barrier phase that use completes.
// Consumers wait on full(stage) for `phase`; the producer waits on empty(stage) for `phase ^ 1` (a fresh
// barrier counts parity 1 as completed, so the first pass through the ring does not wait).
template <int STAGES>
struct PipeState {
  int stage = 0;
  u32 phase = 0;
  __device__ __forceinline__ void advance() {
    if (++stage == STAGES) {
      stage = 0;
      phase ^= 1;
    }
  }
};
