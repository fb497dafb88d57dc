package enginemetrics

import "time"

// peerSlack is how many requests an engine may count beyond one client's own before they are
// taken for another client's: a request cancelled as it was sent may be counted after the
// client took it for ended, and an engine's gauges may lag a step behind.
const peerSlack = 2.5

// peerRebase is how often at most an engine idle at a scrape, with nothing of the client's in
// flight, starts its count again: so that requests cancelled as they were sent, counted late,
// do not add up over hours to another client's, while another client's few requests a minute
// still add up to one.
const peerRebase = time.Minute

// Peers tells from an engine's scrapes whether clients other than one (a proxy replica) send
// it requests: by its count of the requests it served (Load.Requests) and its requests waiting
// and running. The zero Peers knows nothing.
type Peers struct {
	// base is the engine's count, and ended the client's ended requests when its scrape was
	// sent, at the scrape the count is weighed from (the first, the one that last counted
	// another's, one after a restart or at an idle moment); since is when.
	base  float64
	ended int64
	known bool
	since time.Time
	// othersAt is when a scrape last counted another client's request (zero: never).
	othersAt time.Time
}

// Scrape is what one scrape tells of an engine and of the client's requests to it.
type Scrape struct {
	// Load is the engine's report.
	Load Load
	// Started is how many requests the client had started on the engine by the answer;
	// Ended, how many it had ended when it sent the scrape.
	Started, Ended int64
}

// Next is p after s, a scrape at now. An engine that shows no count is not known to count
// (one whose counter has a label, a finish reason, shows none until a request ended there).
// Alone, the engine's count since the base is at most the client's requests started by now
// less those it had ended when the base's scrape was sent: it counts each once, as it takes
// it in or as it ends it, and those ended before the base it had counted then; and it has no
// more requests waiting and running than the client's started and not ended. More (by
// peerSlack) are another client's. A count lower than its base is an engine restarted: the
// count starts again.
func (p Peers) Next(s Scrape, now time.Time) Peers {
	if s.Load.Requests < 0 {
		return Peers{othersAt: p.othersAt}
	}
	q := p
	if !p.known || s.Load.Requests < p.base {
		q = p.rebased(s, now)
	}
	inFlight := float64(s.Started - s.Ended)
	switch {
	case float64(s.Load.Waiting+s.Load.Running) > inFlight+peerSlack || s.Load.Requests-q.base > float64(s.Started-q.ended)+peerSlack:
		q = q.rebased(s, now)
		q.othersAt = now
	case s.Started == s.Ended && s.Load.Waiting+s.Load.Running == 0 && now.Sub(q.since) >= peerRebase:
		// Nothing in flight on either side: the count holds every request the client sent
		// that it will ever hold, and what cancellations put off counting starts again.
		q = q.rebased(s, now)
	}
	return q
}

// rebased is p weighing the engine's count from s, a scrape at now.
func (p Peers) rebased(s Scrape, now time.Time) Peers {
	p.base, p.ended, p.known, p.since = s.Load.Requests, s.Ended, true, now
	return p
}

// Counted reports whether the engine's count of requests is read: Sole is then worth showing.
func (p Peers) Counted() bool { return p.known }

// Sole reports whether, by the scrapes so far, the engine has served no request but the
// client's for after, or ever. An engine that does not count its requests is never sole.
func (p Peers) Sole(now time.Time, after time.Duration) bool {
	return p.known && (p.othersAt.IsZero() || now.Sub(p.othersAt) >= after)
}
