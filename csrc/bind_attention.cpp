// STUB: replaced by the attention kernel family's bindings.
#include "bind.h"

namespace ninfer {
void bind_attention(pybind11::module_& m) { (void)m; }
}  // namespace ninfer
