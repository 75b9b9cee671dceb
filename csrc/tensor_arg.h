// Tensors at the binding: a kernel's argument arrives as the torch.Tensor itself, and the binding
// reads its data pointer, shape, strides, dtype and device and checks them against the kernel's
// contract before anything launches. A wrong shape from Python is then a ValueError naming the
// op and the argument, never an out-of-bounds write on the GPU.
//
// Written by hand rather than taken from torch's C++ API: including torch's headers would tie the
// extension to one torch build's C++ ABI and make every binding file a minute-long compile; the
// few attributes read here through Python (data_ptr, dtype, shape, stride, get_device) are the
// stable public surface of every torch version we support.
#pragma once

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <array>
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "ops.h"

namespace ninfer {

enum class ScalarType : int { F32, F16, BF16, F64, I64, I32, I16, I8, U8, F8E4M3, Bool, Other };

const char* scalar_type_name(ScalarType type);
int element_size(ScalarType type);  // bytes

inline constexpr int kMaxDims = 6;
inline constexpr std::int64_t kAny = -1;  // a shape entry that matches any size

struct TensorArg {
  std::uintptr_t data = 0;
  ScalarType type = ScalarType::Other;
  int device = -1;  // CUDA device index; -1 for any other device
  int dim = 0;
  std::array<std::int64_t, kMaxDims> sizes{};
  std::array<std::int64_t, kMaxDims> strides{};

  std::int64_t size(int axis) const { return sizes[axis < 0 ? axis + dim : axis]; }
  std::int64_t stride(int axis) const { return strides[axis < 0 ? axis + dim : axis]; }
  std::int64_t numel() const;
  bool contiguous() const;  // dense row-major (size-1 axes may have any stride)
  std::string shape_str() const;
};

// Whether the bytes the two tensors' views span (first to last element) intersect.
bool overlaps(const TensorArg& a, const TensorArg& b);

// Raised when every tensor passed the shape / dtype / layout checks but one is not on the CUDA
// device of the others (Python: ninfer_core._C.DeviceError, a ValueError). Distinct so that the
// CPU test suite can drive a binding through all of its checks with CPU tensors.
struct DeviceError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

class ArgCheck;

// The checks of one tensor argument; each returns *this so they chain. An absent optional
// argument passes every check.
class TensorCheck {
 public:
  TensorCheck(const ArgCheck& call, const char* name, const TensorArg* tensor)
      : call_(call), name_(name), t_(tensor) {}
  TensorCheck& shape(std::initializer_list<std::int64_t> sizes);  // kAny matches any size
  TensorCheck& dtype(ScalarType type);
  TensorCheck& dtype(std::initializer_list<ScalarType> types);
  TensorCheck& contiguous();
  TensorCheck& unit_last_stride();  // rows of any stride, elements contiguous within a row
  TensorCheck& min_numel(std::int64_t count);
  TensorCheck& aligned(int bytes);  // the data pointer
  TensorCheck& same_dtype(const TensorArg& other, const char* other_name);
  TensorCheck& matches(const TensorArg& other, const char* other_name);  // same shape and dtype
  TensorCheck& disjoint(const TensorArg& other, const char* other_name);  // shares no byte with other

 private:
  [[noreturn]] void fail(const std::string& what) const;
  const ArgCheck& call_;
  const char* name_;
  const TensorArg* t_;
};

// The checks of one call: `check("x", x).shape({m, k}).dtype(...)` per tensor, `check.require(...)`
// for relations between integers, `check.device()` last (every tensor seen on one CUDA device).
class ArgCheck {
 public:
  explicit ArgCheck(const char* op) : op_(op) {}
  TensorCheck operator()(const char* name, const TensorArg& t);
  TensorCheck operator()(const char* name, const std::optional<TensorArg>& t);
  // ValueError "op: <parts streamed>" unless condition; the message is built only on failure
  // (bindings run this on every eager kernel call).
  template <class... Parts>
  void require(bool condition, const Parts&... parts) const {
    if (!condition) fail(concat(parts...));
  }
  int device() const;
  [[noreturn]] void fail(const std::string& what) const;

 private:
  template <class... Parts>
  static std::string concat(const Parts&... parts) {
    std::ostringstream out;
    (out << ... << parts);
    return out.str();
  }
  const char* op_;
  std::vector<std::pair<const char*, const TensorArg*>> seen_;
};

// The kernels' element type of a float tensor (ValueError for any other).
DType kernel_dtype(const ArgCheck& check, const char* name, const TensorArg& t);

inline std::uintptr_t data_or_null(const std::optional<TensorArg>& t) { return t ? t->data : 0; }

// Registers DeviceError with the module (bindings.cpp).
void register_tensor_arg(pybind11::module_& m);

// Fills `out` from a torch.Tensor; false when `src` is not one.
bool read_tensor(pybind11::handle src, TensorArg& out);

}  // namespace ninfer

namespace pybind11::detail {

template <>
struct type_caster<ninfer::TensorArg> {
  PYBIND11_TYPE_CASTER(ninfer::TensorArg, const_name("torch.Tensor"));
  bool load(handle src, bool /*convert*/) { return ninfer::read_tensor(src, value); }
  static handle cast(const ninfer::TensorArg&, return_value_policy, handle) {
    throw cast_error("a TensorArg is an argument only");
  }
};

}  // namespace pybind11::detail
