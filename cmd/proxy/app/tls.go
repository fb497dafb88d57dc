package app

import (
	"crypto/tls"
	"errors"
	"fmt"
)

// listenerTLS is the proxy listener's TLS config, or nil when it serves plain HTTP. The
// files are read once, at startup: a certificate that cannot be loaded fails the start
// rather than the first client's handshake.
func listenerTLS(c Config) (*tls.Config, error) {
	if c.TLSCertFile == "" && c.TLSKeyFile == "" {
		return nil, nil
	}
	if c.TLSCertFile == "" || c.TLSKeyFile == "" {
		return nil, errors.New("config: tls_cert_file and tls_key_file: set both to serve HTTPS, or neither")
	}
	cert, err := tls.LoadX509KeyPair(c.TLSCertFile, c.TLSKeyFile)
	if err != nil {
		return nil, fmt.Errorf("config: tls_cert_file, tls_key_file: %w", err)
	}
	// TLS 1.0 and 1.1 are deprecated (RFC 8996). HTTP/2 is offered by ALPN: ServeTLS adds
	// "h2" to NextProtos.
	return &tls.Config{MinVersion: tls.VersionTLS12, Certificates: []tls.Certificate{cert}}, nil
}
