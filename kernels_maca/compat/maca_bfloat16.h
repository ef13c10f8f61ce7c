// Compatibility build only: <maca_bfloat16.h> of the MetaX SDK, resolved onto CUDA (mappings in maca_compat.h).
#pragma once
#include "maca_compat.h"
