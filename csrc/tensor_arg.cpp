// TensorArg: reading a torch.Tensor at the binding, and the checks of tensor_arg.h.
#include "tensor_arg.h"

#include <utility>

namespace py = pybind11;

namespace ninfer {

namespace {

struct TorchTypes {
  py::object tensor_class;
  std::vector<std::pair<py::object, ScalarType>> dtypes;
};

// torch's Tensor class and dtype objects, looked up once (torch is imported before any kernel call).
const TorchTypes& torch_types() {
  static const TorchTypes* types = [] {
    py::module_ torch = py::module_::import("torch");
    auto* t = new TorchTypes{torch.attr("Tensor"), {}};
    const std::pair<const char*, ScalarType> names[] = {
        {"float32", ScalarType::F32}, {"float16", ScalarType::F16}, {"bfloat16", ScalarType::BF16},
        {"float64", ScalarType::F64},
        {"int64", ScalarType::I64},   {"int32", ScalarType::I32},   {"int16", ScalarType::I16},
        {"int8", ScalarType::I8},     {"uint8", ScalarType::U8},    {"bool", ScalarType::Bool},
        {"float8_e4m3fn", ScalarType::F8E4M3},
    };
    for (const auto& [name, type] : names) {
      if (py::hasattr(torch, name)) t->dtypes.emplace_back(torch.attr(name), type);
    }
    return t;  // leaked on purpose: Python objects must not be released after interpreter shutdown
  }();
  return *types;
}

std::string shape_of(std::initializer_list<std::int64_t> sizes) {
  std::string s = "(";
  for (auto it = sizes.begin(); it != sizes.end(); ++it) {
    if (it != sizes.begin()) s += ", ";
    s += *it == kAny ? "*" : std::to_string(*it);
  }
  return s + (sizes.size() == 1 ? ",)" : ")");
}

}  // namespace

const char* scalar_type_name(ScalarType type) {
  switch (type) {
    case ScalarType::F32: return "float32";
    case ScalarType::F16: return "float16";
    case ScalarType::BF16: return "bfloat16";
    case ScalarType::F64: return "float64";
    case ScalarType::I64: return "int64";
    case ScalarType::I32: return "int32";
    case ScalarType::I16: return "int16";
    case ScalarType::I8: return "int8";
    case ScalarType::U8: return "uint8";
    case ScalarType::F8E4M3: return "float8_e4m3fn";
    case ScalarType::Bool: return "bool";
    case ScalarType::Other: break;
  }
  return "an unsupported dtype";
}

// Through the CPython API with interned names: this runs for every tensor of every kernel call
// outside CUDA graphs, so it is kept to one attribute read or method call per property.
int element_size(ScalarType type) {
  switch (type) {
    case ScalarType::F64:
    case ScalarType::I64: return 8;
    case ScalarType::F32:
    case ScalarType::I32: return 4;
    case ScalarType::F16:
    case ScalarType::BF16:
    case ScalarType::I16: return 2;
    default: return 1;
  }
}

bool overlaps(const TensorArg& a, const TensorArg& b) {
  if (a.numel() == 0 || b.numel() == 0) return false;
  const auto span_end = [](const TensorArg& t) {
    std::int64_t last = 0;
    for (int i = 0; i < t.dim; ++i) last += (t.sizes[i] - 1) * t.strides[i];
    return t.data + (last + 1) * element_size(t.type);
  };
  return a.data < span_end(b) && b.data < span_end(a);
}

bool read_tensor(py::handle src, TensorArg& out) {
  const TorchTypes& torch = torch_types();
  PyObject* obj = src.ptr();
  const int is_tensor = PyObject_IsInstance(obj, torch.tensor_class.ptr());
  if (is_tensor <= 0) {
    if (is_tensor < 0) PyErr_Clear();
    return false;
  }
  static PyObject* const shape_name = PyUnicode_InternFromString("shape");
  static PyObject* const stride_name = PyUnicode_InternFromString("stride");
  static PyObject* const data_ptr_name = PyUnicode_InternFromString("data_ptr");
  static PyObject* const get_device_name = PyUnicode_InternFromString("get_device");
  static PyObject* const dtype_name = PyUnicode_InternFromString("dtype");
  const py::object shape = py::reinterpret_steal<py::object>(PyObject_GetAttr(obj, shape_name));
  const py::object stride = py::reinterpret_steal<py::object>(PyObject_CallMethodNoArgs(obj, stride_name));
  const py::object data = py::reinterpret_steal<py::object>(PyObject_CallMethodNoArgs(obj, data_ptr_name));
  const py::object device = py::reinterpret_steal<py::object>(PyObject_CallMethodNoArgs(obj, get_device_name));
  const py::object dtype = py::reinterpret_steal<py::object>(PyObject_GetAttr(obj, dtype_name));
  if (!shape || !stride || !data || !device || !dtype || !PyTuple_Check(shape.ptr()) || !PyTuple_Check(stride.ptr())) {
    throw py::error_already_set();
  }
  const Py_ssize_t dim = PyTuple_GET_SIZE(shape.ptr());
  if (dim > kMaxDims || PyTuple_GET_SIZE(stride.ptr()) != dim) {
    throw py::value_error("a kernel argument has " + std::to_string(dim) + " dimensions (at most " +
                          std::to_string(kMaxDims) + ")");
  }
  out.dim = static_cast<int>(dim);
  for (Py_ssize_t i = 0; i < dim; ++i) {
    out.sizes[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(shape.ptr(), i));
    out.strides[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(stride.ptr(), i));
  }
  out.data = static_cast<std::uintptr_t>(PyLong_AsUnsignedLongLong(data.ptr()));
  out.device = static_cast<int>(PyLong_AsLong(device.ptr()));
  out.type = ScalarType::Other;
  for (const auto& [object, type] : torch.dtypes) {
    if (dtype.ptr() == object.ptr()) out.type = type;
  }
  return true;
}

std::int64_t TensorArg::numel() const {
  std::int64_t n = 1;
  for (int i = 0; i < dim; ++i) n *= sizes[i];
  return n;
}

bool TensorArg::contiguous() const {
  std::int64_t expected = 1;
  for (int i = dim - 1; i >= 0; --i) {
    if (sizes[i] == 0) return true;
    if (sizes[i] != 1 && strides[i] != expected) return false;
    expected *= sizes[i];
  }
  return true;
}

std::string TensorArg::shape_str() const {
  std::string s = "(";
  for (int i = 0; i < dim; ++i) s += (i ? ", " : "") + std::to_string(sizes[i]);
  return s + (dim == 1 ? ",)" : ")");
}

void TensorCheck::fail(const std::string& what) const { call_.fail(std::string(name_) + " " + what); }

TensorCheck& TensorCheck::shape(std::initializer_list<std::int64_t> sizes) {
  if (!t_) return *this;
  bool ok = static_cast<int>(sizes.size()) == t_->dim;
  int i = 0;
  for (auto it = sizes.begin(); ok && it != sizes.end(); ++it, ++i) ok = *it == kAny || *it == t_->sizes[i];
  if (!ok) fail("has shape " + t_->shape_str() + ", expected " + shape_of(sizes));
  return *this;
}

TensorCheck& TensorCheck::dtype(ScalarType type) { return dtype({type}); }

TensorCheck& TensorCheck::dtype(std::initializer_list<ScalarType> types) {
  if (!t_) return *this;
  std::string names;
  for (ScalarType type : types) {
    if (type == t_->type) return *this;
    names += (names.empty() ? "" : " or ") + std::string(scalar_type_name(type));
  }
  fail(std::string("is ") + scalar_type_name(t_->type) + ", expected " + names);
}

TensorCheck& TensorCheck::same_dtype(const TensorArg& other, const char* other_name) {
  if (t_ && t_->type != other.type) {
    fail(std::string("is ") + scalar_type_name(t_->type) + ", " + other_name + " " + scalar_type_name(other.type) +
         ": they must match");
  }
  return *this;
}

TensorCheck& TensorCheck::matches(const TensorArg& other, const char* other_name) {
  if (!t_) return *this;
  bool same = t_->dim == other.dim;
  for (int i = 0; same && i < other.dim; ++i) same = t_->sizes[i] == other.sizes[i];
  if (!same) fail("has shape " + t_->shape_str() + ", " + other_name + " " + other.shape_str() + ": they must match");
  return same_dtype(other, other_name);
}

TensorCheck& TensorCheck::disjoint(const TensorArg& other, const char* other_name) {
  if (t_ && overlaps(*t_, other)) fail(std::string("overlaps ") + other_name);
  return *this;
}

TensorCheck& TensorCheck::contiguous() {
  if (t_ && !t_->contiguous()) fail("must be contiguous (shape " + t_->shape_str() + ")");
  return *this;
}

TensorCheck& TensorCheck::unit_last_stride() {
  if (t_ && t_->dim > 0 && t_->size(-1) > 1 && t_->stride(-1) != 1) fail("needs a contiguous last axis");
  return *this;
}

TensorCheck& TensorCheck::min_numel(std::int64_t count) {
  if (t_ && t_->numel() < count) {
    fail("has " + std::to_string(t_->numel()) + " elements, needs at least " + std::to_string(count));
  }
  return *this;
}

TensorCheck& TensorCheck::aligned(int bytes) {
  if (t_ && t_->data % bytes) fail("must start at a " + std::to_string(bytes) + "-byte aligned address");
  return *this;
}

TensorCheck ArgCheck::operator()(const char* name, const TensorArg& t) {
  seen_.emplace_back(name, &t);
  return TensorCheck(*this, name, &t);
}

TensorCheck ArgCheck::operator()(const char* name, const std::optional<TensorArg>& t) {
  if (t) seen_.emplace_back(name, &*t);
  return TensorCheck(*this, name, t ? &*t : nullptr);
}

void ArgCheck::fail(const std::string& what) const { throw py::value_error(std::string(op_) + ": " + what); }

int ArgCheck::device() const {
  int device = -1;
  for (const auto& [name, t] : seen_) {
    if (t->device < 0) throw DeviceError(std::string(op_) + ": " + name + " is not on a CUDA device");
    if (device >= 0 && t->device != device) {
      throw DeviceError(std::string(op_) + ": " + name + " is on cuda:" + std::to_string(t->device) + ", " +
                        seen_.front().first + " on cuda:" + std::to_string(device));
    }
    device = t->device;
  }
  return device;
}

DType kernel_dtype(const ArgCheck& check, const char* name, const TensorArg& t) {
  switch (t.type) {
    case ScalarType::F32: return DType::F32;
    case ScalarType::F16: return DType::F16;
    case ScalarType::BF16: return DType::BF16;
    default: check.fail(std::string(name) + " is " + scalar_type_name(t.type) + ", expected a float dtype");
  }
}

void register_tensor_arg(py::module_& m) {
  py::register_exception<DeviceError>(m, "DeviceError", PyExc_ValueError);
}

}  // namespace ninfer
