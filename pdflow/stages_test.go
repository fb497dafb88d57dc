package pdflow

import (
	"errors"
	"testing"
)

func TestTheMigrationStagePassesWholeEventsAndStopsAtAnErrorEvent(t *testing.T) {
	rs := &resume{left: 1}
	first := `data: {"id":"c1","choices":[{"index":0,"text":"a"}]}` + "\n\n"
	out, err := rs.Pass([]byte(first[:10]), nil)
	if len(out) != 0 || err != nil {
		t.Fatalf("half an event: passed %q, error %v; want nothing yet", out, err)
	}
	out, err = rs.Pass([]byte(first[10:]), nil)
	if string(out) != first || err != nil {
		t.Fatalf("its end: passed %q, error %v; want the whole event", out, err)
	}
	out, err = rs.Pass([]byte(`data: {"error":{"message":"boom"}}`+"\n\n"+first), nil)
	if len(out) != 0 || !errors.Is(err, errErrorEvent) {
		t.Fatalf("an error event: passed %q, error %v; want nothing and errErrorEvent", out, err)
	}
}
