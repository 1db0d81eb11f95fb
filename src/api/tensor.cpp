#include "flashkda/flashkda.h"

namespace flashkda {

const char* dtype_name(DType t) {
  switch (t) {
    case DType::kBF16: return "bfloat16";
    case DType::kF32: return "float32";
    case DType::kI32: return "int32";
    case DType::kI64: return "int64";
    case DType::kF16: return "float16";
    case DType::kF64: return "float64";
  }
  return "unknown dtype";
}

size_t dtype_size(DType t) {
  switch (t) {
    case DType::kBF16:
    case DType::kF16: return 2;
    case DType::kF32:
    case DType::kI32: return 4;
    case DType::kI64:
    case DType::kF64: return 8;
  }
  return 0;
}

int64_t Tensor::stride(int i) const {
  bool none = true;
  for (int d = 0; d < ndim && d < kMaxDims; ++d) none &= strides[d] == 0;
  if (!none) return strides[i];
  int64_t s = 1;
  for (int d = ndim - 1; d > i; --d) s *= shape[d];
  return s;
}

bool Tensor::dense() const {
  if (numel() == 0) return true;  // no elements, no layout (frameworks give such tensors any strides)
  int64_t expected = 1;
  for (int d = (ndim < kMaxDims ? ndim : kMaxDims) - 1; d >= 0; --d) {
    if (shape[d] != 1 && stride(d) != expected) return false;
    expected *= shape[d];
  }
  return true;
}

int64_t Tensor::numel() const {
  int64_t n = 1;
  for (int i = 0; i < ndim && i < kMaxDims; ++i) n *= shape[i];
  return n;
}

static Tensor make(const void* data, DType dtype, int ndim, const int64_t* dims) {
  Tensor t;
  t.data = const_cast<void*>(data);
  t.dtype = dtype;
  t.ndim = ndim;
  for (int i = 0; i < ndim && i < kMaxDims; ++i) t.shape[i] = dims[i];
  return t;
}

Tensor make_strided_tensor(const void* data, DType dtype, int ndim, const int64_t* shape, const int64_t* strides) {
  Tensor t = make(data, dtype, ndim, shape);
  for (int i = 0; i < ndim && i < kMaxDims; ++i) t.strides[i] = strides[i];
  return t;
}

Tensor make_tensor(const void* data, DType dtype, int64_t d0) {
  const int64_t d[] = {d0};
  return make(data, dtype, 1, d);
}
Tensor make_tensor(const void* data, DType dtype, int64_t d0, int64_t d1) {
  const int64_t d[] = {d0, d1};
  return make(data, dtype, 2, d);
}
Tensor make_tensor(const void* data, DType dtype, int64_t d0, int64_t d1, int64_t d2) {
  const int64_t d[] = {d0, d1, d2};
  return make(data, dtype, 3, d);
}
Tensor make_tensor(const void* data, DType dtype, int64_t d0, int64_t d1, int64_t d2, int64_t d3) {
  const int64_t d[] = {d0, d1, d2, d3};
  return make(data, dtype, 4, d);
}
Tensor make_tensor(const void* data, DType dtype, int64_t d0, int64_t d1, int64_t d2, int64_t d3, int64_t d4) {
  const int64_t d[] = {d0, d1, d2, d3, d4};
  return make(data, dtype, 5, d);
}

}  // namespace flashkda
