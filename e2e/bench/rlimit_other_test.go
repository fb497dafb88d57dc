//go:build !unix

package bench

// raiseNoFile does nothing where there is no RLIMIT_NOFILE; the scale scenario then opens
// as many streams as the system lets it.
func raiseNoFile(want uint64) (uint64, error) { return want, nil }
