// STUB: replaced by the moe kernel family's bindings.
#include "bind.h"

namespace ninfer {
void bind_moe(pybind11::module_& m) { (void)m; }
}  // namespace ninfer
