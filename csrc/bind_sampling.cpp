// STUB: replaced by the sampling kernel family's bindings.
#include "bind.h"

namespace ninfer {
void bind_sampling(pybind11::module_& m) { (void)m; }
}  // namespace ninfer
