// STUB: replaced by the quant kernel family's bindings.
#include "bind.h"

namespace ninfer {
void bind_quant(pybind11::module_& m) { (void)m; }
}  // namespace ninfer
