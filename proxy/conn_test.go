package proxy

import "testing"

func TestRequestLineVersionIsFollowedAcrossReads(t *testing.T) {
	const get11, get10 = "GET /v1/models HTTP/1.1\r\nHost: p\r\n\r\n", "GET /v1/models HTTP/1.0\r\nHost: p\r\n\r\n"
	for _, tc := range []struct {
		name   string
		reads  []string
		http11 bool
	}{
		{"HTTP/1.1 in one read", []string{get11}, true},
		{"HTTP/1.1 cut at the preface's length", []string{get11[:14], get11[14:]}, true},
		{"HTTP/1.1 cut inside its version", []string{get11[:20], get11[20:22], get11[22:]}, true},
		{"HTTP/1.1 cut between CR and LF", []string{get11[:24], get11[24:]}, true},
		{"HTTP/1.1 ended by a bare LF", []string{"GET / HTTP/1.1\nHost: p\n\n"}, true},
		{"HTTP/1.0", []string{get10}, false},
		{"HTTP/1.0 cut inside its version", []string{get10[:22], get10[22:]}, false},
		{"HTTP/1.1 further down, not on the request line", []string{"GET / HTTP/1.0\r\nX: HTTP/1.1\r\n\r\n"}, false},
		{"a line not ended yet", []string{get11[:20]}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := &clientConn{inLine: true}
			for _, r := range tc.reads {
				if c.inLine {
					c.readLine([]byte(r))
				}
			}
			if c.http11 != tc.http11 {
				t.Errorf("http11 = %v, want %v", c.http11, tc.http11)
			}
		})
	}
}
