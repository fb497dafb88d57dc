package h1client

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptrace"
	"net/textproto"
	"strconv"
	"strings"
)

// The response parser accepts what net/http's transport accepts (http.ReadResponse, then its
// transport's framing) and refuses what it refuses, so that engine_client lean and stdlib
// answer a backend alike. It is stricter in a few places only, each where the input is how
// responses are smuggled or split, or cannot be framed at all (FuzzParseHead holds the list):
//   - Transfer-Encoding and Content-Length on one body (RFC 9112 section 6.3 says it "ought
//     to be handled as an error"; net/http drops the Content-Length and reads chunks);
//   - Transfer-Encoding in an HTTP/1.0 response (RFC 9112 section 6.1: the framing is faulty;
//     net/http ignores the field and frames by Content-Length or the close);
//   - whitespace in a field name, as in "Content-Length : 5" (RFC 9112 section 5.1; net/http
//     keeps such a field under its raw name, so it frames the body as if it were absent);
//   - a version other than HTTP/1.x ("HTTP/0.9", "HTTP/2.0" in text), which says the peer does
//     not frame as HTTP/1.1 does, and a status code below 100 or signed ("+20", "-00"), which
//     RFC 9110 section 15 does not define and net/http takes as a final answer;
//   - 101 Switching Protocols: this client never asks to upgrade, and it cannot hand the
//     connection over (net/http gives a writable body to a 101 with Upgrade).

// DefaultMaxResponseHeaderBytes is Options.MaxResponseHeaderBytes when zero: net/http's
// transport's default (its MaxResponseHeaderBytes).
const DefaultMaxResponseHeaderBytes = 10 << 20

// Limits net/http's chunked reader sets, kept so that a chunked body framed by one client is
// framed by the other.
const (
	// maxChunkLine bounds a chunk-size line, its CRLF included.
	maxChunkLine = 4 << 10
	// maxChunkOverhead bounds the bytes of chunk heads beyond 16 per chunk plus twice its
	// data: tiny chunks with long extensions are a way to make a reader spin.
	maxChunkOverhead = 16 << 10
)

// HeadTooLargeError is a response whose head (status line and header lines, interim 1xx
// answers included) is over the limit, Options.MaxResponseHeaderBytes.
type HeadTooLargeError struct{ Limit int64 }

func (e *HeadTooLargeError) Error() string {
	return fmt.Sprintf("response head over the limit of %d bytes", e.Limit)
}

var (
	errLineTooLong = errors.New("chunk size line over 4096 bytes")
	errTrailerEOF  = errors.New("unexpected EOF reading trailer")
)

// The refusals of what net/http accepts, listed at the top of the file; FuzzParseHead lets
// them through, and no other.
var (
	errBothFramings = errors.New("response has both Transfer-Encoding and Content-Length")
	errTE10         = errors.New("HTTP/1.0 response with Transfer-Encoding")
	errKeySpace     = errors.New("whitespace in a header field name")
	errVersion      = errors.New("not an HTTP/1.x response")
	errStatusCode   = errors.New("status code below 100 or signed")
	errSwitch       = errors.New("101 Switching Protocols to a request that asked for no upgrade")
)

// readResponse reads the response to req from c, past any 1xx: a 100 Continue is the
// trace's Got100Continue, the backend's acknowledgement that its handler took the request.
func (c *conn) readResponse(req *http.Request, trace *httptrace.ClientTrace) (*http.Response, error) {
	return readResponse(c.br, req.Method, c.p.opts.MaxResponseHeaderBytes, trace)
}

// readResponse reads a response head from br and frames its body (resp.Body is a *body).
// limit bounds the heads read, interim answers included, as net/http's transport bounds them
// when no trace takes the 1xx answers (Got1xxResponse, which this client does not offer).
func readResponse(br *bufio.Reader, method string, limit int64, trace *httptrace.ClientTrace) (*http.Response, error) {
	left := limit
	for {
		resp, err := parseHead(br, &left)
		if err != nil {
			var tl *HeadTooLargeError
			if errors.As(err, &tl) {
				tl.Limit = limit
			}
			return nil, fmt.Errorf("read response head: %w", err)
		}
		if resp.StatusCode == http.StatusSwitchingProtocols {
			return nil, fmt.Errorf("read response head: %w", errSwitch)
		}
		if resp.StatusCode < 200 {
			// net/http frames an interim answer too, and refuses it on the same grounds.
			if err := frame(resp, method, br); err != nil {
				return nil, err
			}
			if resp.StatusCode == http.StatusContinue && trace != nil && trace.Got100Continue != nil {
				trace.Got100Continue()
			}
			continue
		}
		if err := frame(resp, method, br); err != nil {
			return nil, err
		}
		return resp, nil
	}
}

// parseHead reads a status line and header fields, drawing their bytes from *left. It is the
// part of the client a backend's bytes reach first, hence FuzzParseHead.
func parseHead(br *bufio.Reader, left *int64) (*http.Response, error) {
	line, err := readLine(br, left)
	if err != nil {
		return nil, unexpected(err)
	}
	// HTTP-version SP status-code [SP reason-phrase]; like net/http, more spaces before the
	// code, and any HTTP/1 minor version (RFC 9112 section 2.3: read as HTTP/1.1).
	if len(line) < 9 || string(line[:5]) != "HTTP/" || !isDigit(line[5]) || line[6] != '.' || !isDigit(line[7]) || line[8] != ' ' {
		return nil, fmt.Errorf("malformed status line %q", truncate(line))
	}
	if line[5] != '1' {
		return nil, fmt.Errorf("%w %q", errVersion, truncate(line))
	}
	resp := &http.Response{ProtoMajor: 1, ProtoMinor: int(line[7] - '0')}
	switch resp.ProtoMinor {
	case 1:
		resp.Proto = "HTTP/1.1"
	case 0:
		resp.Proto = "HTTP/1.0"
	default:
		resp.Proto = string(line[:8])
	}
	status := bytes.TrimLeft(line[9:], " ")
	code, _, _ := bytes.Cut(status, []byte(" "))
	if len(code) != 3 || code[0] < '1' || code[0] > '9' || !isDigit(code[1]) || !isDigit(code[2]) {
		if n, err := strconv.Atoi(string(code)); len(code) == 3 && err == nil && n >= 0 {
			return nil, fmt.Errorf("%w in %q", errStatusCode, truncate(line)) // net/http takes it
		}
		return nil, fmt.Errorf("malformed status code in %q", truncate(line))
	}
	resp.StatusCode = int(code[0]-'0')*100 + int(code[1]-'0')*10 + int(code[2]-'0')
	resp.Status = string(status)
	if resp.Header, err = readHeader(br, left); err != nil {
		return nil, err
	}
	// RFC 9111 section 5.4, as net/http has it: Pragma: no-cache is Cache-Control: no-cache.
	if p := resp.Header["Pragma"]; len(p) > 0 && p[0] == "no-cache" {
		if _, ok := resp.Header["Cache-Control"]; !ok {
			resp.Header["Cache-Control"] = []string{"no-cache"}
		}
	}
	return resp, nil
}

// readHeader reads header fields up to the empty line that ends them, as textproto's
// ReadMIMEHeader does: a line starting with a space or tab continues the one before (obs-fold,
// RFC 9112 section 5.2, which a client must turn into spaces), values are trimmed, and a
// value's bytes are VCHAR, obs-text, space and tab. Unlike it, a field name must be a token.
func readHeader(br *bufio.Reader, left *int64) (http.Header, error) {
	h := make(http.Header, 6)
	if p, err := br.Peek(1); err == nil && (p[0] == ' ' || p[0] == '\t') {
		return nil, errors.New("malformed header: the first line is a continuation")
	}
	for {
		line, err := readLine(br, left)
		if err != nil {
			return nil, unexpected(err)
		}
		if len(line) == 0 {
			return h, nil
		}
		i := bytes.IndexByte(line, ':')
		if i < 0 {
			return nil, fmt.Errorf("malformed header line %q", truncate(line))
		}
		rawKey := line[:i]
		if len(rawKey) == 0 {
			return nil, fmt.Errorf("malformed header line %q", truncate(line))
		}
		for _, b := range rawKey {
			if b == ' ' {
				return nil, fmt.Errorf("%w: %q", errKeySpace, truncate(rawKey))
			}
			if !isTokenByte(b) {
				return nil, fmt.Errorf("malformed header key %q", truncate(rawKey))
			}
		}
		k, ok := commonKeys[string(rawKey)]
		if !ok {
			k = textproto.CanonicalMIMEHeaderKey(string(rawKey))
		}
		v := trimOWS(line[i+1:])
		if !validValue(v) {
			return nil, fmt.Errorf("malformed header value of %q", k)
		}
		value := string(v) // line is the reader's buffer, which the Peek below may refill
		for {
			if p, err := br.Peek(1); err != nil || p[0] != ' ' && p[0] != '\t' {
				break
			}
			for {
				p, err := br.Peek(1)
				if err != nil || p[0] != ' ' && p[0] != '\t' {
					break
				}
				br.Discard(1)
				*left--
			}
			if *left < 0 {
				return nil, &HeadTooLargeError{}
			}
			cont, err := readLine(br, left)
			if err != nil {
				return nil, unexpected(err)
			}
			cont = trimOWS(cont)
			if !validValue(cont) {
				return nil, fmt.Errorf("malformed header value of %q", k)
			}
			value += " " + string(cont)
		}
		if len(value) > 0 && (value[0] == ' ' || value[0] == '\t') {
			value = strings.TrimLeft(value, " \t") // an empty first line, folded
		}
		h[k] = append(h[k], value)
	}
}

func validValue(v []byte) bool {
	for _, b := range v {
		if b < ' ' && b != '\t' || b == 0x7f {
			return false
		}
	}
	return true
}

// commonKeys spares the canonicalising of the header names engines send.
var commonKeys = func() map[string]string {
	m := map[string]string{}
	for _, k := range []string{"Content-Type", "Content-Length", "Transfer-Encoding", "Connection", "Date", "Server", "Cache-Control", "X-Request-Id", "Keep-Alive", "X-Accel-Buffering"} {
		m[k] = k
		m[string(bytes.ToLower([]byte(k)))] = k
	}
	return m
}()

// readLine reads one line, without its CRLF (or bare LF, which RFC 9112 section 2.2 lets a
// recipient take in a head), drawing its bytes from *left. A line cut off by the end of input
// is an error: in a head, no line can be the last thing a server sends.
func readLine(br *bufio.Reader, left *int64) ([]byte, error) {
	line, err := readSlice(br, *left)
	if err == errOverLimit {
		return nil, &HeadTooLargeError{}
	}
	if err != nil {
		return nil, err
	}
	*left -= int64(len(line))
	line = line[:len(line)-1]
	if n := len(line); n > 0 && line[n-1] == '\r' {
		line = line[:n-1]
	}
	return line, nil
}

// errOverLimit is readSlice's line over its limit.
var errOverLimit = errors.New("line over the limit")

// readSlice reads through the next LF, and fails when that is more than limit bytes. A line
// longer than the reader's buffer is gathered into a new slice; a shorter one is the buffer's.
func readSlice(br *bufio.Reader, limit int64) ([]byte, error) {
	line, err := br.ReadSlice('\n')
	if err == bufio.ErrBufferFull {
		long := append([]byte(nil), line...)
		for err == bufio.ErrBufferFull {
			if int64(len(long)) > limit {
				return nil, errOverLimit
			}
			line, err = br.ReadSlice('\n')
			long = append(long, line...)
		}
		line = long
	}
	if err != nil {
		return nil, err
	}
	if int64(len(line)) > limit {
		return nil, errOverLimit
	}
	return line, nil
}

func truncate(b []byte) []byte {
	if len(b) > 64 {
		return b[:64]
	}
	return b
}

func isDigit(c byte) bool { return '0' <= c && c <= '9' }

func isTokenByte(c byte) bool {
	// RFC 9110 tchar.
	switch {
	case c >= 'a' && c <= 'z', c >= 'A' && c <= 'Z', c >= '0' && c <= '9':
		return true
	}
	switch c {
	case '!', '#', '$', '%', '&', '\'', '*', '+', '-', '.', '^', '_', '`', '|', '~':
		return true
	}
	return false
}

// frame decides how resp's body ends (RFC 9112 section 6.3, in net/http's readTransfer's
// order: the checks of Transfer-Encoding and Content-Length hold whatever the status), and
// gives resp its Body. It leaves resp's header as net/http does: Transfer-Encoding gone into
// resp.TransferEncoding, one Content-Length, Trailer gone into resp.Trailer's keys, and
// Connection gone when it says close on HTTP/1.1.
func frame(resp *http.Response, method string, br *bufio.Reader) error {
	h := resp.Header
	chunked := false
	if te, ok := h["Transfer-Encoding"]; ok {
		delete(h, "Transfer-Encoding")
		if resp.ProtoMinor == 0 {
			return errTE10
		}
		if len(te) != 1 {
			return fmt.Errorf("too many transfer encodings %q", te)
		}
		if !equalFold(te[0], "chunked") {
			return fmt.Errorf("unsupported Transfer-Encoding %q", te[0])
		}
		chunked = true
		resp.TransferEncoding = []string{"chunked"}
	}
	cl := h["Content-Length"]
	if len(cl) > 1 {
		for _, v := range cl[1:] {
			if v != cl[0] {
				return fmt.Errorf("conflicting Content-Length %q", cl)
			}
		}
		cl = cl[:1]
		h["Content-Length"] = cl
	}
	declared := int64(-1)
	if len(cl) > 0 {
		n, err := strconv.ParseUint(cl[0], 10, 63)
		if err != nil {
			return fmt.Errorf("malformed Content-Length %q", cl[0])
		}
		declared = int64(n)
	}
	bodyAllowed := resp.StatusCode >= 200 && resp.StatusCode != http.StatusNoContent && resp.StatusCode != http.StatusNotModified
	hasBody := bodyAllowed && method != http.MethodHead
	length := int64(0) // of what follows the head
	switch {
	case !hasBody:
	case chunked:
		if len(cl) > 0 {
			return errBothFramings
		}
		length = -1
	default:
		length = declared
	}
	resp.ContentLength = length
	if method == http.MethodHead {
		resp.ContentLength = declared
	}
	if tr, ok := h["Trailer"]; ok && chunked {
		delete(h, "Trailer")
		resp.Trailer = make(http.Header)
		for _, v := range tr {
			for _, k := range strings.Split(v, ",") {
				if k = textproto.TrimString(k); k == "" {
					continue
				}
				switch k = http.CanonicalHeaderKey(k); k {
				case "Transfer-Encoding", "Trailer", "Content-Length":
					return fmt.Errorf("bad trailer key %q", k)
				}
				resp.Trailer[k] = nil
			}
		}
	}
	hasClose := hasToken(h["Connection"], "close")
	resp.Close = hasClose || resp.ProtoMinor == 0 && !hasToken(h["Connection"], "keep-alive")
	if hasClose && resp.ProtoMinor > 0 {
		delete(h, "Connection")
	}
	b := &body{br: br, n: length}
	switch {
	case hasBody && chunked:
		b.chunked, b.n = true, 0
		b.trailer = &resp.Trailer
	case length == 0:
		b.done = true
	case length < 0:
		// Until the server closes: the connection cannot be reused.
		resp.Close = true
	}
	b.reuse = !resp.Close
	resp.Body = b
	return nil
}

func hasToken(vs []string, token string) bool {
	for _, v := range vs {
		for len(v) > 0 {
			var t string
			t, v, _ = strings.Cut(v, ",")
			if equalFold(strings.Trim(t, " \t"), token) {
				return true
			}
		}
	}
	return false
}

func trimOWS(b []byte) []byte {
	for len(b) > 0 && (b[0] == ' ' || b[0] == '\t') {
		b = b[1:]
	}
	for len(b) > 0 && (b[len(b)-1] == ' ' || b[len(b)-1] == '\t') {
		b = b[:len(b)-1]
	}
	return b
}

func equalFold(a, b string) bool {
	if len(a) != len(b) {
		return false
	}
	for i := 0; i < len(a); i++ {
		x, y := a[i], b[i]
		if 'A' <= x && x <= 'Z' {
			x += 'a' - 'A'
		}
		if 'A' <= y && y <= 'Z' {
			y += 'a' - 'A'
		}
		if x != y {
			return false
		}
	}
	return true
}

func unexpected(err error) error {
	if err == io.EOF {
		return io.ErrUnexpectedEOF
	}
	return err
}
