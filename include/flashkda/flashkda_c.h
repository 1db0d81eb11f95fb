/* FlashKDA C ABI: a thin layer over the C++ API (flashkda.h) for other languages.
 * Functions return 0 on success or a flashkda error code (see FLASHKDA_ERR_*); the message of
 * the last error on this thread is available from flashkda_last_error(). */
#ifndef FLASHKDA_C_H_
#define FLASHKDA_C_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

enum { FLASHKDA_BF16 = 0, FLASHKDA_F32 = 1, FLASHKDA_I32 = 2, FLASHKDA_I64 = 3, FLASHKDA_F16 = 4, FLASHKDA_F64 = 5 };
enum { FLASHKDA_GATE_SAFE = 0, FLASHKDA_GATE_SOFTPLUS = 1 };
enum { FLASHKDA_STATE_LAYOUT_VK = 0, FLASHKDA_STATE_LAYOUT_KV = 1 };
enum {
  FLASHKDA_OK = 0,
  FLASHKDA_ERR_INVALID_ARGUMENT = 1,
  FLASHKDA_ERR_UNSUPPORTED = 2,
  FLASHKDA_ERR_NO_DEVICE = 3,
  FLASHKDA_ERR_CUDA = 4,
  FLASHKDA_ERR_INTERNAL = 5
};

/* A dense row-major tensor. An optional tensor with data == NULL and ndim == 0 is "not given"; one
   with dimensions is given even when empty (and then checked like any other). */
typedef struct flashkda_tensor {
  void* data;
  int32_t dtype;
  int32_t ndim;
  int64_t shape[5];
  int64_t strides[5];  /* elements; all zero: dense row-major (see Tensor in flashkda.h) */
} flashkda_tensor;

typedef struct flashkda_forward_args {
  flashkda_tensor q, k, v, g, beta, A_log, dt_bias;
  flashkda_tensor initial_state, cu_seqlens, out, final_state;
  float lower_bound;
  float scale;
  int32_t gate;          /* FLASHKDA_GATE_* */
  int32_t seqlen_check;  /* 0: validate device cu_seqlens on the host (syncs); 1: device guards only */
  /* State pools (see ForwardArgs in flashkda.h): optional, zero-initialise when unused. */
  flashkda_tensor state_indices, final_state_indices;
  int32_t state_layout;  /* FLASHKDA_STATE_LAYOUT_* */
  /* Prefix checkpoints (see ForwardArgs): optional, zero-initialise when unused. */
  flashkda_tensor checkpoint_offsets, checkpoint_state;
  /* Per-token states (see ForwardArgs): optional, zero-initialise when unused. */
  flashkda_tensor token_state_indices;
} flashkda_forward_args;

int flashkda_forward_workspace_size(const flashkda_forward_args* args, size_t* bytes);
/* stream: a cudaStream_t, or NULL for the default stream. */
int flashkda_forward(const flashkda_forward_args* args, void* workspace, size_t workspace_bytes, void* stream);
const char* flashkda_last_error(void);
const char* flashkda_version(void);

#ifdef __cplusplus
}
#endif

#endif /* FLASHKDA_C_H_ */
