package proxy

import (
	"bytes"
	"io"

	"github.com/pdproxy/pdproxy/engine"
)

// A stage is one step of the relay between what the decoder sent and what goes to the
// client: handed the bytes of one read and end, the read's error (nil while the answer goes
// on, io.EOF at its end, another error when it broke), it hands on the bytes that go further
// and the error that stands. The relay runs a chain of them over every read (relayStages):
// the migration's filter (resume), the Messages translation (chatToMessages), the renaming of
// an alias's model (renamer); each holds across reads what it needs to cut whole events.
type stage interface {
	pass(data []byte, end error) ([]byte, error)
}

// relayStages is the chain of stages of the exchange's answer, in their order: whole events
// for a stream that may go on elsewhere first, then the answer in its client's API, then its
// model's name.
func (x *exchange) relayStages() []stage {
	var chain []stage
	if x.out.resume != nil {
		chain = append(chain, x.out.resume)
	}
	if x.out.translate != nil {
		chain = append(chain, x.out.translate)
	}
	if x.names.rename != nil {
		chain = append(chain, x.names.rename)
	}
	return chain
}

// pass is the migration's filter as a stage: whole events only, an error event stopping the
// stream (errErrorEvent), so that a stream that goes on elsewhere leaves no half of one.
func (rs *resume) pass(data []byte, end error) ([]byte, error) {
	data = rs.filter(data)
	if rs.errorEvent && end == nil {
		end = errErrorEvent
	}
	return data, end
}

// pass is the Messages translation as a stage: the chat answer's events become the Messages
// answer's, the last of them at the answer's end; an answer it cannot translate fails.
func (t *chatToMessages) pass(data []byte, end error) ([]byte, error) {
	data = t.rewrite(data)
	if end == io.EOF {
		data = append(data, t.flush()...)
	}
	if t.err != nil && (end == nil || end == io.EOF) {
		end = t.err
	}
	return data, end
}

// pass is the renaming as a stage: the served model's name becomes the one the client asked
// for; what it held back for a name split across reads goes out when the answer ends, however.
func (r *renamer) pass(data []byte, end error) ([]byte, error) {
	data = r.rewrite(data)
	if end != nil {
		data = append(data, r.flush()...)
	}
	return data, end
}

// endWatch watches the bytes that reached the client for the end of the answer: it keeps
// their last tailSize bytes, and, for an API whose streams end with an event of their own
// (Responses, Messages), whether that event went by.
type endWatch struct {
	api   engine.API
	tail  []byte
	ended bool
}

// note records data, written to the client after what came before.
func (w *endWatch) note(data []byte) {
	if ends := streamEnds(w.api); ends != nil && !w.ended {
		w.ended = sawEnd(w.tail, data, ends)
	}
	n := len(data)
	w.tail = append(w.tail, data[max(0, n-tailSize):n]...)
	w.tail = w.tail[max(0, len(w.tail)-tailSize):]
}

// complete reports whether the stream written so far ended as its API ends one: a completion
// or chat stream with its [DONE], a Responses or Messages stream with its last event and the
// blank line after it.
func (w *endWatch) complete() bool {
	if streamEnds(w.api) != nil {
		return w.ended && (bytes.HasSuffix(w.tail, []byte("\n\n")) || bytes.HasSuffix(w.tail, []byte("\r\n\r\n")))
	}
	return streamDone(w.tail)
}

// eventBreak is what ends the partial SSE event the stream stopped in (eventBreak).
func (w *endWatch) eventBreak() []byte { return eventBreak(w.tail) }
