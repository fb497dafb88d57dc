// Package costmodel is the arithmetic of placing a request by what its prefill will cost:
// every candidate engine is given one number, the time to the request's first token there,
// and the lowest wins.
//
//	cost = fixed + (uncached + ahead) × time per token
//
// uncached is the prompt tokens the engine would compute for the request, those its prefix
// cache does not hold; ahead is the work queued or running there before it, in the same
// tokens, of which Books keep the requests sent there whose prefill has not ended. The time
// per token and the fixed part are a line fitted through the pool's prefills, each one's work
// against the time to its end (Model.Learn), the line a Model is built with until there are
// enough of them. Caching is worth exactly what it saves in that sum: a hot shared preamble
// held everywhere saves the same everywhere, and the load decides; a long private context held
// on one engine keeps its conversation there until the queue there outweighs it.
//
// Costs whose work (past the fixed part) is within tieShare of the lowest's, or within
// tieTokens of it, are ties (Model.Choose): a preferred engine first (a session's), then
// those with the least work ahead, within tieTokens (a hot prompt held on one engine spreads
// rather than queue there for a saving too small to tell); then the order the caller ranks
// them in, one every replica computes alike. Where the caller knows the blocks each computed
// lately, the SpreadChoices first in that order are taken by them: the first within
// spreadShare of the fewest, so that new work goes where the least work went and none gets a
// double share by the luck of a hash. With a temperature the pick is instead drawn with
// weights exp(-(cost - lowest) / temperature), so that replicas do not all herd onto one
// engine between two scrapes.
package costmodel

import (
	"math"
	"sync"
	"sync/atomic"
	"time"
)

const (
	// learnWeight is the weight of one observation in an engine's own rate (EngineRate) and
	// in the pool's mean uncached tokens.
	learnWeight = 0.1
	// minLearnTokens: a prefill of less work than this says more about the overhead and the
	// network than about the rate, and teaches nothing.
	minLearnTokens = 128
	// learnClamp bounds how far one observation may pull the rate, either way.
	learnClamp = 8
)

// Model is one pool's cost settings and what it learns across its engines: the line through
// its prefills, the mean uncached tokens of its picks and how late its predictions run. It is
// safe for concurrent use.
type Model struct {
	decodeTokens float64
	temperature  float64 // seconds; 0 picks the lowest
	// meanUncached is the mean uncached tokens of the pool's picks (float64 bits).
	meanUncached atomic.Uint64
	// fit is the line through the pool's prefills: its time per token and fixed part.
	fit fit
	// late is the 90th percentile of how much later than predicted the pool's prefills
	// ended, in seconds (float64 bits; 0 for early).
	late atomic.Uint64
}

// New is a Model whose line starts at overhead for the fixed part of a prefill's time and
// tokensPerSecond for its rate. decodeTokens is what one request decoding on an engine weighs
// in the work ahead there, in prefill tokens. With a positive temperature Choose draws the
// pick by weight instead of taking the lowest.
func New(overhead time.Duration, tokensPerSecond, decodeTokens float64, temperature time.Duration) *Model {
	m := &Model{decodeTokens: decodeTokens, temperature: temperature.Seconds()}
	m.fit.slope0, m.fit.intercept0 = 1/tokensPerSecond, overhead.Seconds()
	return m
}

// DecodeTokens is what one request decoding on an engine weighs in the work ahead there, in
// prefill tokens.
func (m *Model) DecodeTokens() float64 { return m.decodeTokens }

// Rate is the prefill time per token, in seconds, every engine of the pool is weighed at: the
// pool's fit of its engines' prefills, the rate the Model was built with before there are
// enough of them. One rate for the pool: an engine's own rate learned apart goes stale while
// the engine is not picked, and the engines that are picked learn faster ones, so that the
// first engines to serve would look faster than the others for ever and take everything. Each
// engine's own rate (EngineRate) is learned apart, only to be shown.
func (m *Model) Rate() float64 {
	slope, _ := m.fit.line()
	return slope
}

// Fixed is the fixed part of a prefill's time in seconds, as fitted, the overhead the Model
// was built with before.
func (m *Model) Fixed() float64 {
	_, intercept := m.fit.line()
	return intercept
}

// Seconds is the predicted time to the first token of a request of work tokens (its own
// uncached and those ahead).
func (m *Model) Seconds(work float64) float64 {
	return m.Fixed() + work*m.Rate()
}

// Learn teaches the pool's line one prefill: work tokens (its own and those ahead at its
// pick) that took observed. It reports whether the prefill taught anything: one of fewer than
// minLearnTokens does not.
func (m *Model) Learn(work float64, observed time.Duration) bool {
	if work < minLearnTokens {
		return false
	}
	m.fit.add(work, observed.Seconds())
	return true
}

// NoteUncached folds a pick's uncached tokens into the pool's mean.
func (m *Model) NoteUncached(u float64) {
	for {
		old := m.meanUncached.Load()
		mean := math.Float64frombits(old)
		next := mean + learnWeight*(u-mean)
		if mean == 0 {
			next = u
		}
		if m.meanUncached.CompareAndSwap(old, math.Float64bits(next)) {
			return
		}
	}
}

// MeanUncached is the mean uncached tokens of the pool's picks (NoteUncached), 0 before the
// first: what a request an engine reports and that was not placed here is taken to weigh.
func (m *Model) MeanUncached() float64 {
	return math.Float64frombits(m.meanUncached.Load())
}

// lateStep is how far one prefill moves the tracked 90th percentile of lateness.
const lateStep = 0.001

// NoteLate tracks the 90th percentile of the predictions' lateness (a prefill's time less the
// time predicted, negative for early) by stochastic approximation: a prefill later than it
// raises it by 9 steps, one not later lowers it by 1, which settles where one prefill in ten
// is later.
func (m *Model) NoteLate(late time.Duration) {
	s := late.Seconds()
	for {
		old := m.late.Load()
		q := math.Float64frombits(old)
		next := q - lateStep
		if s > q {
			next = q + 9*lateStep
		}
		if m.late.CompareAndSwap(old, math.Float64bits(max(next, 0))) {
			return
		}
	}
}

// Lateness is the tracked 90th percentile of the predictions' lateness (NoteLate), 0 when
// they are mostly early.
func (m *Model) Lateness() time.Duration {
	return time.Duration(math.Float64frombits(m.late.Load()) * float64(time.Second))
}

// fit is a least-squares line through a pool's prefills, time against work, each lesson
// weighing fitWeight (more while there are fewer than 1/fitWeight): its slope is the time per
// token, its intercept the fixed part. The line is worked out at each lesson and read without
// the lock: every candidate of every pick reads it.
type fit struct {
	mu               sync.Mutex
	n                float64
	mx, my, mxx, mxy float64
	// slope and intercept are the line as of the latest lesson (float64 bits; slope 0 while
	// there are fewer than fitLessons).
	slope, intercept atomic.Uint64
	// slope0, intercept0 are the configured line, set before the first lesson.
	slope0, intercept0 float64
}

const (
	fitWeight = 0.05
	// fitLessons: before so many lessons, the configured line.
	fitLessons = 8
)

func (f *fit) add(x, y float64) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.n++
	a := max(1/f.n, fitWeight)
	f.mx += a * (x - f.mx)
	f.my += a * (y - f.my)
	f.mxx += a * (x*x - f.mxx)
	f.mxy += a * (x*y - f.mxy)
	if f.n < fitLessons || f.mx <= 0 {
		return
	}
	// While the prefills' work is too alike to part the two (its spread under a tenth of its
	// mean), the configured intercept and the slope through the mean past it; the slope
	// within learnClamp² of the configured one, the intercept at least 0.
	clamp := func(s float64) float64 {
		return min(max(s, f.slope0/(learnClamp*learnClamp)), f.slope0*learnClamp*learnClamp)
	}
	slope, intercept := clamp((f.my-f.intercept0)/f.mx), f.intercept0
	if v := f.mxx - f.mx*f.mx; v >= 0.01*f.mx*f.mx {
		slope = clamp((f.mxy - f.mx*f.my) / v)
		intercept = max(f.my-slope*f.mx, 0)
	}
	f.slope.Store(math.Float64bits(slope))
	f.intercept.Store(math.Float64bits(intercept))
}

// line is the fitted slope and intercept, the configured ones before fitLessons lessons.
func (f *fit) line() (slope, intercept float64) {
	if s := math.Float64frombits(f.slope.Load()); s > 0 {
		return s, math.Float64frombits(f.intercept.Load())
	}
	return f.slope0, f.intercept0
}

// EngineRate is one engine's own prefill time per token, as its prefills show it apart from
// the pool's. Its zero value has learned nothing; it is safe for concurrent use.
type EngineRate struct {
	bits atomic.Uint64 // seconds per token, float64 bits
}

// Fold moves the rate one lesson's weight toward sample (within learnClamp of it), from start
// when it has none yet.
func (r *EngineRate) Fold(sample, start float64) {
	for {
		old := r.bits.Load()
		cur := math.Float64frombits(old)
		if cur <= 0 {
			cur = start
		}
		clamped := min(max(sample, cur/learnClamp), cur*learnClamp)
		next := cur + learnWeight*(clamped-cur)
		if r.bits.CompareAndSwap(old, math.Float64bits(next)) {
			return
		}
	}
}

// SecondsPerToken is the rate as folded, 0 before the first lesson.
func (r *EngineRate) SecondsPerToken() float64 {
	return math.Float64frombits(r.bits.Load())
}
