package api

import (
	"bytes"

	"github.com/pdproxy/pdproxy/engine"
)

// tailSize is how many of the answer's last bytes the relay keeps: enough for the line end
// before "data: [DONE]", and the blank line after it; and for the longest line that ends a
// Responses stream ("event: response.incomplete"), split across two reads.
const tailSize = 32

// streamDone reports whether a stream's last bytes are its [DONE] event: a line "data:
// [DONE]" (the space is optional in SSE) that starts a line and ends the event with a blank
// line.
func streamDone(tail []byte) bool {
	t := bytes.TrimRight(tail, "\r\n")
	ends := tail[len(t):]
	if bytes.Count(ends, []byte("\n"))+bytes.Count(ends, []byte("\r"))-bytes.Count(ends, []byte("\r\n")) < 2 {
		return false
	}
	for _, done := range [][]byte{[]byte("data: [DONE]"), []byte("data:[DONE]")} {
		if i := len(t) - len(done); i >= 0 && bytes.Equal(t[i:], done) {
			return i == 0 || t[i-1] == '\n' || t[i-1] == '\r'
		}
	}
	return false
}

// eventBreak is what ends the partial SSE event a stream stopped in, given its last bytes:
// nothing on an event boundary (a blank line), one more line end after a complete line.
func eventBreak(tail []byte) []byte {
	switch {
	case len(tail) == 0 || bytes.HasSuffix(tail, []byte("\n\n")):
		return nil
	case tail[len(tail)-1] == '\n':
		return []byte("\n")
	}
	// A lone CR ends a line too, but a CR followed by this LF is one line end: two LFs are
	// needed either way.
	return []byte("\n\n")
}

// CountEvents counts the SSE events in p, which stand for tokens in a completion stream.
func CountEvents(p []byte) int {
	n := bytes.Count(p, []byte("data:"))
	n -= bytes.Count(p, []byte("data: [DONE]"))
	if n < 0 {
		return 0
	}
	return n
}

// EndWatch watches the bytes that reached the client for the end of the answer: it keeps
// their last tailSize bytes, and, for an API whose streams end with an event of their own
// (Responses, Messages), whether that event went by.
type EndWatch struct {
	API   engine.API
	tail  []byte
	ended bool
}

// Note records data, written to the client after what came before.
func (w *EndWatch) Note(data []byte) {
	if ends := streamEnds(w.API); ends != nil && !w.ended {
		w.ended = sawEnd(w.tail, data, ends)
	}
	n := len(data)
	w.tail = append(w.tail, data[max(0, n-tailSize):n]...)
	w.tail = w.tail[max(0, len(w.tail)-tailSize):]
}

// Complete reports whether the stream written so far ended as its API ends one: a completion
// or chat stream with its [DONE], a Responses or Messages stream with its last event and the
// blank line after it.
func (w *EndWatch) Complete() bool {
	if streamEnds(w.API) != nil {
		return w.ended && (bytes.HasSuffix(w.tail, []byte("\n\n")) || bytes.HasSuffix(w.tail, []byte("\r\n\r\n")))
	}
	return streamDone(w.tail)
}

// EventBreak is what ends the partial SSE event the stream stopped in (EventBreak).
func (w *EndWatch) EventBreak() []byte { return eventBreak(w.tail) }

// A Stage is one step of the relay between what the decoder sent and what goes to the
// client: handed the bytes of one read and end, the read's error (nil while the answer goes
// on, io.EOF at its end, another error when it broke), it hands on the bytes that go further
// and the error that stands. The relay runs a chain of them over every read (Pass): the
// migration's filter, the Messages translation (ChatToMessages), the renaming of an alias's
// model (Renamer); each holds across reads what it needs to cut whole events.
type Stage interface {
	Pass(data []byte, end error) ([]byte, error)
}

// Pass hands one read, data with its error end, through chain in its order.
func Pass(chain []Stage, data []byte, end error) ([]byte, error) {
	for _, st := range chain {
		data, end = st.Pass(data, end)
	}
	return data, end
}

// streamEnds are the event names that end a stream of api, whose streams have no [DONE]; nil
// for an API whose streams end with it.
func streamEnds(api engine.API) [][]byte {
	switch api {
	case engine.APIResponses:
		return responsesEnds
	case engine.APIMessages:
		return messagesEnds
	}
	return nil
}

// responsesEnds are the event names that end a Responses stream: it has no [DONE].
var responsesEnds = [][]byte{[]byte("response.completed"), []byte("response.incomplete"), []byte("response.failed")}

// sawEnd reports whether data, read after tail (the relay's last bytes of the stream before
// it), holds the event that ends a Responses stream: an SSE field line "event:" naming it,
// which starts a line and ends there. The same words inside a data line (generated text,
// JSON-escaped, so never on a line of their own) are no end. A line split across the two
// reads is looked for where they meet, so that no read is copied whole; the line and the
// line ends around it fit in tailSize.
func sawEnd(tail, data []byte, ends [][]byte) bool {
	edge := append(tail[:len(tail):len(tail)], data[:min(len(data), tailSize)]...)
	// The edge begins the stream when the tail is shorter than the relay keeps; data's own
	// first line is looked at in the edge, where the byte before it is.
	return endLine(data, false, ends) || endLine(edge, len(tail) < tailSize, ends)
}

// endLine reports whether p holds a line "event: <end>" (the space is optional in SSE) with
// its line end; atStart says whether p begins a line.
func endLine(p []byte, atStart bool, ends [][]byte) bool {
	for off := 0; ; {
		i := bytes.Index(p[off:], []byte("event:"))
		if i < 0 {
			return false
		}
		i += off
		off = i + 1
		if i == 0 && !atStart || i > 0 && p[i-1] != '\n' && p[i-1] != '\r' {
			continue
		}
		v := p[i+len("event:"):]
		if len(v) > 0 && v[0] == ' ' {
			v = v[1:]
		}
		for _, end := range ends {
			if len(v) > len(end) && bytes.HasPrefix(v, end) && (v[len(end)] == '\n' || v[len(end)] == '\r') {
				return true
			}
		}
	}
}

// messagesEnds are the events that end a Messages stream: it has no [DONE]. An engine's
// error event ends it too.
var messagesEnds = [][]byte{[]byte("message_stop"), []byte("error")}
