#include "shoestring/core/error.h"
// (Error is header-only; this file anchors the core library.)
