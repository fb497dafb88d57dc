package kvcache

import (
	"syscall"
	"unsafe"
)

// adviseHuge asks the kernel to back the whole huge pages inside the n bytes at p with huge
// pages, where it is set to do so when asked (transparent_hugepage "madvise", the usual
// default): a table of hundreds of megabytes is read at random, and with 4 KiB pages nearly
// every lookup also misses the TLB, and its first touch of each page faults. It is advice
// only: an error leaves the memory as it was.
func adviseHuge(p unsafe.Pointer, n int) {
	start := (uintptr(p) + hugePage - 1) &^ (hugePage - 1)
	end := (uintptr(p) + uintptr(n)) &^ (hugePage - 1)
	if end <= start {
		return
	}
	at := unsafe.Add(p, start-uintptr(p))
	_ = syscall.Madvise(unsafe.Slice((*byte)(at), end-start), syscall.MADV_HUGEPAGE)
}
