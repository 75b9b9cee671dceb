// STUB: the quant kernel family goes here.
#include "common.cuh"
