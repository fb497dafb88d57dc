package api

import (
	"bytes"
	"errors"
	"io"
	"strings"
	"testing"

	"github.com/pdproxy/pdproxy/engine"
)

// runStages hands reads through chain as the relay does, end being the last read's error,
// and answers what went further and the error that stands.
func runStages(chain []Stage, reads []string, end error) ([]byte, error) {
	var out []byte
	var err error
	for i, r := range reads {
		var e error
		if i == len(reads)-1 {
			e = end
		}
		data, e := Pass(chain, []byte(r), e)
		out = append(out, data...)
		if e != nil {
			err = e
			break
		}
	}
	return out, err
}

func TestTheRenamingStageRenamesANameSplitAcrossReadsAndFlushesAtAnyEnd(t *testing.T) {
	stream := `data: {"model":"served-model","choices":[]}` + "\n\n"
	for cut := 0; cut <= len(stream); cut++ {
		for _, end := range []error{io.EOF, errors.New("the decoder broke")} {
			out, err := runStages([]Stage{NewRenamer("served-model", "alias")}, []string{stream[:cut], stream[cut:]}, end)
			if want := strings.Replace(stream, "served-model", "alias", 1); string(out) != want {
				t.Fatalf("cut at %d, end %v: %q, want %q", cut, end, out, want)
			}
			if err != end {
				t.Fatalf("cut at %d: error %v, want the read's %v", cut, err, end)
			}
		}
	}
}

func TestTheTranslationStageEndsTheMessagesAnswerAndFailsAnAnswerItCannotRead(t *testing.T) {
	out, err := runStages([]Stage{&ChatToMessages{Stream: true}}, []string{chatStream[:40], chatStream[40:]}, io.EOF)
	if err != io.EOF {
		t.Fatalf("error %v, want io.EOF", err)
	}
	names, _ := sseData(t, out)
	if len(names) == 0 || names[len(names)-1] != "message_stop" {
		t.Fatalf("events %v, want the last message_stop", names)
	}
	// While the answer goes on, a good chat stream passes with no error of the stage's.
	if _, err := runStages([]Stage{&ChatToMessages{Stream: true}}, []string{chatStream[:40]}, nil); err != nil {
		t.Fatalf("mid-answer: error %v, want none", err)
	}
	_, err = runStages([]Stage{&ChatToMessages{Stream: true}}, []string{"data: {not json\n\n"}, io.EOF)
	if err == nil || err == io.EOF {
		t.Fatalf("an answer it cannot translate: error %v, want the translation's", err)
	}
}

func TestTheChainTranslatesThenRenames(t *testing.T) {
	chain := []Stage{&ChatToMessages{Stream: true}, NewRenamer("served-model", "alias")}
	stream := strings.ReplaceAll(chatStream, `"model":"m"`, `"model":"served-model"`)
	out, err := runStages(chain, []string{stream}, io.EOF)
	if err != io.EOF {
		t.Fatal(err)
	}
	if bytes.Contains(out, []byte("served-model")) || !bytes.Contains(out, []byte(`"alias"`)) {
		t.Fatalf("the Messages answer of an alias names %s, want the alias", out)
	}
}

func TestTheEndWatchSeesEachAPIsEndWhereverReadsSplit(t *testing.T) {
	for _, tc := range []struct {
		api    engine.API
		stream string
	}{
		{engine.APICompletions, "data: {}\n\ndata: [DONE]\n\n"},
		{engine.APIResponses, "event: response.created\ndata: {}\n\nevent: response.completed\ndata: {}\n\n"},
		{engine.APIMessages, "event: message_delta\ndata: {}\n\nevent: message_stop\ndata: {}\n\n"},
	} {
		for cut := 0; cut <= len(tc.stream); cut++ {
			w := EndWatch{API: tc.api}
			w.Note([]byte(tc.stream[:cut]))
			if cut < len(tc.stream) && w.Complete() {
				t.Fatalf("API %v cut at %d: complete before its end", tc.api, cut)
			}
			w.Note([]byte(tc.stream[cut:]))
			if !w.Complete() {
				t.Fatalf("API %v cut at %d: not complete at its end", tc.api, cut)
			}
		}
		w := EndWatch{API: tc.api}
		w.Note([]byte(tc.stream[:len(tc.stream)-3]))
		if b := w.EventBreak(); len(b) == 0 {
			t.Errorf("API %v: no break after a partial event", tc.api)
		}
	}
}
