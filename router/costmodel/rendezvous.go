package costmodel

import "math"

// FitsBound reports whether a candidate of load and weight may take one more request among
// candidates of total load and total weight weights, under bounded loads with factor c.
func FitsBound(load, total int64, weight, weights int, c float64) bool {
	limit := math.Ceil(c * float64(total+1) * float64(weight) / float64(weights))
	return float64(load+1) <= limit
}

// rendezvousScore is the rank for key of the engine whose name hashes to nameHash, of weight:
// the higher, the earlier. Weighted rendezvous hashing (weight / -ln u, u uniform in (0, 1)
// from the hash) gives each engine a share of the keys in proportion to its weight; with
// equal weights it is the plain order of the hashes. The hash is of the key and the engine's
// name, never its address, so that every replica ranks alike and an engine that moves keeps
// its keys.
func rendezvousScore(key, nameHash uint64, weight int) float64 {
	h := Mix64(key ^ nameHash)
	u := (float64(h>>11) + 0.5) / (1 << 53)
	return float64(max(weight, 1)) / -math.Log(u)
}

// RendezvousRank is what orders candidates as rendezvousScore does: with even weights (every
// candidate of the same weight) the hash alone, with no logarithm.
func RendezvousRank(key, nameHash uint64, weight int, even bool) float64 {
	if even {
		return float64(Mix64(key^nameHash) >> 11)
	}
	return rendezvousScore(key, nameHash, weight)
}

// Mix64 is SplitMix64's finalizer: every bit of x reaches every bit of the result.
func Mix64(x uint64) uint64 {
	x ^= x >> 30
	x *= 0xbf58476d1ce4e5b9
	x ^= x >> 27
	x *= 0x94d049bb133111eb
	x ^= x >> 31
	return x
}
