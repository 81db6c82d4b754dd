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
//
// A freed storage also raises on any read of its data (c10's data-pointer
// access check, which every kernel's data() call already tests), with a
// message that says what was read and what to do instead: a reference that
// escaped sharc's tracking (a `.detach()` kept in a hook) gets an error, never
// freed memory. Gathering into the storage again lifts the check.

#include <string>

#include <c10/core/Storage.h>

namespace sharc {

/// Gives `storage` `nbytes` new, uninitialised bytes on its own device, and
/// makes its data readable again.
void allocate_storage(c10::Storage& storage, int64_t nbytes);

/// Frees the bytes of `storage`; its nbytes() becomes 0 and any later read
/// of its data raises `read_error`.
void free_storage(c10::Storage& storage, std::string read_error);

}  // namespace sharc
