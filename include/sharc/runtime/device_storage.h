#pragma once
// Allocating and freeing the storage behind a gathered buffer, in place.
//
// This is the one file with device specifics. A gathered parameter's base
// buffer keeps one c10::Storage object for its whole life; gathering gives
// that storage fresh bytes from the device's allocator and releasing takes
// them away (nbytes becomes 0). Views of the buffer, and references that a
// compiler keeps to it, therefore never keep released memory alive.
//
// CUDA: the bytes come from the CUDA caching allocator, and ProcessGroupNCCL
// runs the collective on its own stream, records the output on it and makes
// the current stream wait on Work::wait(); freeing on the current stream after
// that wait is therefore ordered after the collective, and no extra events are
// needed here.

#include <c10/core/Storage.h>

namespace sharc {

/// Gives `storage` `nbytes` new, uninitialised bytes on its own device.
void allocate_storage(c10::Storage& storage, int64_t nbytes);

/// Frees the bytes of `storage`; its nbytes() becomes 0.
void free_storage(c10::Storage& storage);

}  // namespace sharc
