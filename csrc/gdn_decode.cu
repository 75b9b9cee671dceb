// STUB: the gdn kernel family goes here.
#include "common.cuh"
