//go:build !linux

package kvcache

import "unsafe"

// adviseHuge does nothing where transparent huge pages are not asked for by madvise.
func adviseHuge(p unsafe.Pointer, n int) {}
