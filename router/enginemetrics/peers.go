package enginemetrics

import "time"

// PeerSlack is how many requests an engine may count beyond one client's own before they are
// taken for another client's: a request cancelled as it was sent may be counted after the
// client took it for ended.
const PeerSlack = 2.5

// Peers tells from an engine's count of the requests it served (Load.Requests) whether
// clients other than one (a proxy replica) send it requests. The zero Peers knows nothing.
type Peers struct {
	// base is the engine's count, and ended the client's ended requests when its scrape was
	// sent, at the scrape from which the engine counted no request but the client's (the
	// first, or the one that last counted another's).
	base  float64
	ended int64
	known bool
	// othersAt is when a scrape last counted another client's request (zero: never).
	othersAt time.Time
}

// Next is p after a scrape at now in which the engine counted served requests (negative: it
// does not count them), the client having started started by the answer and ended ended
// when it sent the scrape. Alone, the engine's count since the base is at most the client's
// requests started by now less those it had ended when the base's scrape was sent: it counts
// each once, as it takes it in or as it ends it, and those ended before the base it had
// counted then. More (by PeerSlack) are another client's. A count lower than its base is an
// engine restarted: the count starts again.
func (p Peers) Next(served float64, started, ended int64, now time.Time) Peers {
	switch {
	case served < 0:
		return Peers{othersAt: p.othersAt}
	case !p.known || served < p.base:
		return Peers{base: served, ended: ended, known: true, othersAt: p.othersAt}
	case served-p.base > float64(started-p.ended)+PeerSlack:
		return Peers{base: served, ended: ended, known: true, othersAt: now}
	}
	return p
}

// Sole reports whether, by the scrapes so far, the engine has served no request but the
// client's for after (or ever, if it counted another's less than after ago). An engine that
// does not count its requests is never sole.
func (p Peers) Sole(now time.Time, after time.Duration) bool {
	return p.known && (p.othersAt.IsZero() || now.Sub(p.othersAt) >= after)
}
