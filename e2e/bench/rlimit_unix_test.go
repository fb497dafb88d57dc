//go:build unix

package bench

import (
	"fmt"
	"syscall"
)

// raiseNoFile raises RLIMIT_NOFILE to want (the hard limit too, which takes privileges) and
// returns the limit now in force: the soft limit it got to, which may be less than want.
func raiseNoFile(want uint64) (uint64, error) {
	var lim syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &lim); err != nil {
		return 0, fmt.Errorf("getrlimit: %w", err)
	}
	if uint64(lim.Cur) >= want {
		return uint64(lim.Cur), nil
	}
	raised := lim
	raised.Cur = want
	if uint64(raised.Max) < want {
		raised.Max = want
	}
	if err := syscall.Setrlimit(syscall.RLIMIT_NOFILE, &raised); err != nil {
		// Not allowed above the hard limit: take all of it.
		lim.Cur = lim.Max
		syscall.Setrlimit(syscall.RLIMIT_NOFILE, &lim)
		return uint64(lim.Cur), fmt.Errorf("raise RLIMIT_NOFILE to %d: %w (%d allowed)", want, err, lim.Cur)
	}
	return want, nil
}
