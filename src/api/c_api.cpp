// The C ABI: converts the C structs to the C++ API and turns exceptions into error codes.
#include "flashkda/flashkda_c.h"

#include <string>

#include "api/arguments.h"
#include "flashkda/flashkda.h"

namespace {

thread_local std::string g_last_error;

flashkda::Tensor to_cpp(const flashkda_tensor& t) {
  flashkda::Tensor r;
  r.data = t.data;
  r.dtype = static_cast<flashkda::DType>(t.dtype);
  r.ndim = t.ndim;
  for (int i = 0; i < flashkda::kMaxDims; ++i) r.shape[i] = t.shape[i], r.strides[i] = t.strides[i];
  return r;
}

flashkda::ForwardArgs to_cpp(const flashkda_forward_args& a) {
  flashkda::ForwardArgs r;
  for (const flashkda::TensorArgument& arg : flashkda::kTensorArguments) r.*arg.member = to_cpp(a.*arg.c_member);
  r.lower_bound = a.lower_bound;
  r.scale = a.scale;
  r.gate = static_cast<flashkda::Gate>(a.gate);
  r.seqlen_check = static_cast<flashkda::SeqlenCheck>(a.seqlen_check);
  r.state_layout = static_cast<flashkda::StateLayout>(a.state_layout);
  return r;
}

template <typename Fn>
int guarded(Fn&& fn) {
  try {
    fn();
    g_last_error.clear();
    return FLASHKDA_OK;
  } catch (const flashkda::Error& e) {
    g_last_error = e.what();
    return static_cast<int>(e.code());
  } catch (const std::exception& e) {
    g_last_error = e.what();
    return FLASHKDA_ERR_INTERNAL;
  }
}

}  // namespace

extern "C" {

int flashkda_forward_workspace_size(const flashkda_forward_args* args, size_t* bytes) {
  return guarded([&] {
    if (!args || !bytes) throw flashkda::Error(flashkda::ErrorCode::kInvalidArgument, "args and bytes must not be NULL");
    *bytes = flashkda::forward_workspace_size(to_cpp(*args));
  });
}

int flashkda_forward(const flashkda_forward_args* args, void* workspace, size_t workspace_bytes, void* stream) {
  return guarded([&] {
    if (!args) throw flashkda::Error(flashkda::ErrorCode::kInvalidArgument, "args must not be NULL");
    flashkda::forward(to_cpp(*args), workspace, workspace_bytes, static_cast<cudaStream_t>(stream));
  });
}

const char* flashkda_last_error(void) { return g_last_error.c_str(); }
const char* flashkda_version(void) { return flashkda::version(); }

}  // extern "C"
