package kvcache

import (
	"fmt"
	"math"
	"slices"
	"strings"

	"github.com/cespare/xxhash/v2"
)

// The tiers a block can be held on. An engine names the medium of every event it publishes;
// the index files each medium under a tier, and a tier's weight says how much of a
// recompute a block held there saves: a GPU block is used as it is, a CPU or disk block is
// loaded first (vLLM's offloading connector, LMCache, SGLang's HiCache).
const (
	// TierGPU is the medium "GPU", and an event that names none.
	TierGPU = "gpu"
	// TierCPU is the medium "CPU".
	TierCPU = "cpu"
	// TierDisk is the media "DISK", "LocalDisk" (LMCache's local disk), "SSD" and "NVMe".
	TierDisk = "disk"
	// TierOther is what Stats counts the blocks of a medium without a tier under: neither
	// GPU, CPU nor a disk, and given no weight by SetTierWeights.
	TierOther = "other"
)

// The default weights of the tiers (what Dynamo's router and llm-d's scorer take): a CPU
// block saves three quarters of its recompute, a disk block a quarter.
const (
	DefaultCPUWeight  = 0.75
	DefaultDiskWeight = 0.25
)

// MaxNamedTiers is how many tiers besides gpu, cpu and disk SetTierWeights may name: each
// is a place in every holder of a block, which holds eight.
const MaxNamedTiers = numSlots - 3

// numSlots is how many tiers a block's holder counts an engine's copies on: slotBits each
// in 32 bits, beside the engine's id in a holder's other 32.
const (
	numSlots = 8
	slotBits = 4
)

// The fixed slots; named tiers take the ones after them.
const (
	slotGPU  = 0
	slotCPU  = 1
	slotDisk = 2
	// noSlot is a medium the index keeps no count for: its blocks chain and are removed,
	// but count as not held.
	noSlot = -1
)

// slotMax is the most copies of one block one slot counts; a further copy (the same tokens
// under yet another hash of the same engine, which only a hostile publisher makes) is not
// indexed, so that the count never spills into the next slot.
const slotMax = 1<<slotBits - 1

// diskMedia are the media names, lower case, of tier disk.
var diskMedia = [...]string{"disk", "localdisk", "local_disk", "ssd", "nvme"}

// TierOf returns the tier of the medium an event names, matched without regard to case:
// TierGPU for "" and "GPU", TierCPU for "CPU", TierDisk for "DISK", "LocalDisk",
// "Local_Disk", "SSD" and "NVMe", and the medium in lower case for any other (a tier only
// if SetTierWeights names it).
func TierOf(medium string) string {
	switch {
	case medium == "" || strings.EqualFold(medium, TierGPU):
		return TierGPU
	case strings.EqualFold(medium, TierCPU):
		return TierCPU
	}
	for _, d := range diskMedia {
		if strings.EqualFold(medium, d) {
			return TierDisk
		}
	}
	return strings.ToLower(medium)
}

// CheckTierWeights says what is wrong with weights for SetTierWeights, nil if nothing:
// tier names are matched without regard to case; every weight is in [0, 1]; gpu's, if
// given, is 1, the unit every other is a share of; a name is not a medium of another tier
// ("ssd" is disk's) nor TierOther; at most MaxNamedTiers names besides gpu, cpu and disk.
func CheckTierWeights(weights map[string]float64) error {
	seen := make(map[string]string, len(weights))
	named := 0
	for name, w := range weights {
		lower := strings.ToLower(name)
		switch {
		case strings.TrimSpace(name) == "" || strings.ContainsFunc(name, func(r rune) bool { return r <= ' ' || r == 0x7f }):
			return fmt.Errorf("tier %q: a medium's name has no spaces or control characters", name)
		case len(name) > 64:
			return fmt.Errorf("tier %q: longer than 64 bytes, no engine names a medium so", name[:64])
		case seen[lower] != "":
			return fmt.Errorf("tier %q and %q: the same tier (names are matched without regard to case)", seen[lower], name)
		case lower == TierOther:
			return fmt.Errorf("tier %q: the name blocks on a medium of no tier are counted under", name)
		case TierOf(name) != lower:
			return fmt.Errorf("tier %q: a medium of tier %s, whose weight it takes: set %s", name, TierOf(name), TierOf(name))
		case math.IsNaN(w) || w < 0 || w > 1:
			return fmt.Errorf("tier %s: weight %v is not in [0, 1]: a held block saves at most its recompute, and at least nothing", name, w)
		case lower == TierGPU && w != 1:
			return fmt.Errorf("tier gpu: weight %v is not 1: a GPU block is used as it is, the unit the other tiers' weights are shares of", w)
		}
		seen[lower] = name
		if lower != TierGPU && lower != TierCPU && lower != TierDisk {
			named++
		}
	}
	if named > MaxNamedTiers {
		return fmt.Errorf("%d tiers besides gpu, cpu and disk: the index keeps at most %d", named, MaxNamedTiers)
	}
	return nil
}

// NamedTiers returns the tiers of weights besides gpu, cpu and disk, in lower case and
// sorted: what the first SetTierWeights fixes.
func NamedTiers(weights map[string]float64) []string {
	var out []string
	for name := range weights {
		switch t := strings.ToLower(name); t {
		case TierGPU, TierCPU, TierDisk:
		default:
			out = append(out, t)
		}
	}
	slices.Sort(out)
	return out
}

// tierTable is the index's tiers: their slots and weights.
type tierTable struct {
	// weight is each slot's weight; slot 0 (GPU) is always 1.
	weight [numSlots]float64
	// names are the named tiers' slots, from slotDisk+1; fixed by the first SetTierWeights
	// (set), so that a block's medium has the same slot while the index holds it.
	names map[string]int
	set   bool
}

func defaultTiers() tierTable {
	var t tierTable
	t.weight[slotGPU], t.weight[slotCPU], t.weight[slotDisk] = 1, DefaultCPUWeight, DefaultDiskWeight
	return t
}

// slotName is the tier of slot s, TierOther for noSlot.
func (t *tierTable) slotName(s int) string {
	switch s {
	case slotGPU:
		return TierGPU
	case slotCPU:
		return TierCPU
	case slotDisk:
		return TierDisk
	}
	for name, i := range t.names {
		if i == s {
			return name
		}
	}
	return TierOther
}

// cpuSalt keeps CPU copies apart in byHash.
var cpuSalt = xxhash.Sum64String(TierCPU)

// medium is the slot of an event's medium and its salt in byHash: the same hash on GPU
// and on CPU (an offloaded copy) are two blocks, and so are a disk copy on "SSD" and one on
// "LocalDisk". GPU, the default, is unsalted.
func (t *tierTable) medium(m string) (slot int, salt uint64) {
	switch {
	case m == "" || strings.EqualFold(m, TierGPU):
		return slotGPU, 0
	case strings.EqualFold(m, TierCPU):
		return slotCPU, cpuSalt
	}
	tier := TierOf(m)
	salt = xxhash.Sum64String(strings.ToLower(m))
	if tier == TierDisk {
		return slotDisk, salt
	}
	if s, ok := t.names[tier]; ok {
		return s, salt
	}
	return noSlot, salt
}
