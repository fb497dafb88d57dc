package routerconfig

import (
	"errors"
	"fmt"
	"net"
	"net/url"
)

// HostPort names a backend after its address, adding the scheme's port when the URL
// has none so that "http://a" and "http://a:80" get the same name.
func HostPort(u *url.URL) string {
	if u.Port() != "" {
		return u.Host
	}
	port := "80"
	if u.Scheme == "https" {
		port = "443"
	}
	return net.JoinHostPort(u.Hostname(), port)
}

func CheckURL(raw string) error {
	if raw == "" {
		return errors.New("required")
	}
	u, err := url.Parse(raw)
	if err != nil {
		return err
	}
	if u.Scheme != "http" && u.Scheme != "https" {
		return fmt.Errorf("%q: scheme must be http or https", raw)
	}
	if u.Hostname() == "" {
		return fmt.Errorf("%q: no host", raw)
	}
	if u.RawQuery != "" || u.Fragment != "" || u.User != nil {
		return fmt.Errorf("%q: no user info, query or fragment allowed", raw)
	}
	return nil
}
