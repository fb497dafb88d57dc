package proxy

import (
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"os"
	"strconv"
	"time"

	"github.com/pdproxy/pdproxy/api"
)

// readBody reads the whole request body, bounded in size and in time: a body announced or
// found larger than the limit is 413 (announced, before a byte of it is read), one that does
// not arrive within read_body_timeout (bodyDeadline) is 408.
func readBody(w http.ResponseWriter, r *http.Request, limit int64, timeout time.Duration) ([]byte, *api.Error) {
	tooLarge := api.NewError(api.KindTooLarge, "request body is larger than the limit of "+formatBytes(limit))
	if r.ContentLength > limit {
		return nil, tooLarge
	}
	// A body read to its end lifts the deadline: net/http's HTTP/1.1 server clears it for its
	// read that watches the connection while the answer is made (or the client would be taken
	// for gone at the deadline); on HTTP/2 it only ever ends the stream's body. After an error
	// it stays: net/http reads what is left of a body before it answers, and must not wait on
	// this one again.
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, limit))
	if err != nil {
		var mbe *http.MaxBytesError
		if errors.As(err, &mbe) {
			return nil, tooLarge
		}
		if errors.Is(err, os.ErrDeadlineExceeded) {
			return nil, api.NewError(api.KindBodyTimeout, "the request body did not arrive within "+timeout.String()).With("", err, 0)
		}
		return nil, api.NewError(api.KindUnreadableBody, "could not read the request body").With("", err, 0)
	}
	return body, nil
}

func formatBytes(n int64) string {
	switch {
	case n >= 1<<20 && n%(1<<20) == 0:
		return strconv.FormatInt(n>>20, 10) + " MiB"
	case n >= 1<<10 && n%(1<<10) == 0:
		return strconv.FormatInt(n>>10, 10) + " KiB"
	}
	return strconv.FormatInt(n, 10) + " bytes"
}

// writeJSON answers v as JSON with status; a 500 in the OpenAI shape when v cannot be encoded.
func writeJSON(w http.ResponseWriter, status int, v any) {
	body, err := json.Marshal(v)
	if err != nil {
		status, body = http.StatusInternalServerError, []byte(`{"error":{"message":"internal error","type":"internal_error","param":null,"code":"internal"}}`)
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	w.Write(body)
}
