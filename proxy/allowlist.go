package proxy

// The llm-d sidecar slot's two parsers: prefiller_allow, the prefillers a request may name,
// and the header that names one (x-prefiller-host-port). Both err on the side of refusing:
// whatever the header names is dialled, so anything ambiguous about it is a 400, and
// anything the allowlist does not plainly cover a 403.

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"path"
	"strconv"
	"strings"
)

// prefillerAddr is a prefiller a request names: a host (an IP address, or a DNS name in lower
// case without a trailing dot) and a port.
type prefillerAddr struct {
	host string
	addr netip.Addr // valid when host is an IP address; IPv4-mapped IPv6 unmapped
	port uint16
}

// hostPort is the prefiller's address as net.Dial takes it (IPv6 in brackets).
func (p prefillerAddr) hostPort() string {
	return net.JoinHostPort(p.host, strconv.Itoa(int(p.port)))
}

// allowlist is prefiller_allow. Its zero value allows nothing.
type allowlist struct {
	prefixes []netip.Prefix // CIDRs: any port
	addrs    []addrPattern  // IP:port, IP:*
	names    []namePattern  // host:port patterns
}

type addrPattern struct {
	addr netip.Addr
	port uint16 // 0: any
}

type namePattern struct {
	labels []string // lower case; a * matches within one label
	port   uint16   // 0: any
}

// errAllowSyntax is what every malformed prefiller_allow entry is told.
const errAllowSyntax = `want a CIDR ("10.0.0.0/8", "fd00::/8": any port), an IP:port ("10.0.0.5:8000", "[fd00::5]:8000") or a host:port pattern ("vllm-prefill-*.ns.svc:8000": a * matches within one DNS label; a port of * matches any)`

// parseAllowlist reads prefiller_allow; an error names the entry.
func parseAllowlist(entries []string) (allowlist, error) {
	var a allowlist
	var errs []error
	for i, e := range entries {
		if err := a.add(strings.TrimSpace(e)); err != nil {
			errs = append(errs, fmt.Errorf("prefiller_allow[%d]: %q: %w", i, e, err))
		}
	}
	return a, errors.Join(errs...)
}

func (a *allowlist) add(e string) error {
	if strings.Contains(e, "/") {
		p, err := netip.ParsePrefix(e)
		if err != nil {
			return errors.New(errAllowSyntax)
		}
		if p.Addr().Zone() != "" {
			return errors.New("an IPv6 zone names an interface, not a prefiller")
		}
		if m := p.Masked(); m != p {
			// Refused rather than masked: "10.0.0.5/8" may as well have meant /32.
			return fmt.Errorf("has bits set past its prefix length; write %s, or a /%d for one address", m, p.Addr().BitLen())
		}
		a.prefixes = append(a.prefixes, unmapPrefix(p))
		return nil
	}
	host, portText, err := net.SplitHostPort(e)
	if err != nil || host == "" {
		return errors.New(errAllowSyntax)
	}
	var port uint16
	if portText != "*" {
		if port, err = parsePort(portText); err != nil {
			return fmt.Errorf("port %q: %w", portText, err)
		}
	}
	if addr, err := netip.ParseAddr(host); err == nil {
		if addr.Zone() != "" {
			return errors.New("an IPv6 zone names an interface, not a prefiller")
		}
		a.addrs = append(a.addrs, addrPattern{addr: addr.Unmap(), port: port})
		return nil
	}
	name := strings.TrimSuffix(strings.ToLower(host), ".")
	labels := strings.Split(name, ".")
	for _, l := range labels {
		if l == "" || strings.Trim(l, "abcdefghijklmnopqrstuvwxyz0123456789-*") != "" {
			return fmt.Errorf("host %q: a DNS name of letters, digits and hyphens, with * for any run of them within a label; %s", host, errAllowSyntax)
		}
	}
	if _, err := netip.ParseAddr(strings.ReplaceAll(name, "*", "0")); err == nil {
		// A pattern over IP addresses written as text would miss their other spellings.
		return fmt.Errorf("host %q: write addresses as a CIDR, e.g. %s", host, strings.ReplaceAll(name, "*", "0")+"/24")
	}
	a.names = append(a.names, namePattern{labels: labels, port: port})
	return nil
}

func unmapPrefix(p netip.Prefix) netip.Prefix {
	if !p.Addr().Is4In6() {
		return p
	}
	bits := p.Bits() - 96
	if bits < 0 {
		// Wider than the whole IPv4-mapped range: keep it as IPv6, where no unmapped
		// address falls.
		return p
	}
	return netip.PrefixFrom(p.Addr().Unmap(), bits)
}

// allows reports whether p is on the list.
func (a *allowlist) allows(p prefillerAddr) bool {
	if p.addr.IsValid() {
		for _, pre := range a.prefixes {
			if pre.Contains(p.addr) {
				return true
			}
		}
		for _, ap := range a.addrs {
			if ap.addr == p.addr && (ap.port == 0 || ap.port == p.port) {
				return true
			}
		}
		return false
	}
	labels := strings.Split(p.host, ".")
	for _, np := range a.names {
		if (np.port == 0 || np.port == p.port) && matchLabels(np.labels, labels) {
			return true
		}
	}
	return false
}

// matchLabels matches a host's labels against a pattern's, one for one: a * never crosses a
// dot, so "vllm-prefill-*.ns.svc" allows no host of another namespace.
func matchLabels(pattern, labels []string) bool {
	if len(pattern) != len(labels) {
		return false
	}
	for i, p := range pattern {
		// The pattern holds only letters, digits, hyphens and *, and a label no slash, so
		// path.Match is a plain glob here and cannot fail.
		if ok, _ := path.Match(p, labels[i]); !ok {
			return false
		}
	}
	return true
}

// maxPrefillerHeader bounds the header's value: a host:port is at most a DNS name (253) and a
// port, and a longer value is no prefiller.
const maxPrefillerHeader = 512

// parsePrefillerHeader reads the prefiller a request names, as llm-d's sidecar does: with the
// header on several lines, or one line of comma-separated values, the first value counts
// (llm-d's default; its scheduler sends one). An absent or empty value names none: llm-d's
// scheduler sends one empty when it chose no prefill, and the request is decoded alone. A
// value is host:port (net.JoinHostPort's form, IPv6 in brackets), optionally after "http://"
// (the older x-prefiller-url form llm-d still accepts). Anything else is an error.
func parsePrefillerHeader(values []string) (p prefillerAddr, named bool, err error) {
	if len(values) == 0 {
		return prefillerAddr{}, false, nil
	}
	// Several lines and one line of comma-separated values are the same list (RFC 9110,
	// section 5.3).
	v, _, _ := strings.Cut(values[0], ",")
	v = strings.TrimSpace(v)
	if v == "" {
		return prefillerAddr{}, false, nil
	}
	if len(v) > maxPrefillerHeader {
		return prefillerAddr{}, true, errors.New("longer than any host:port")
	}
	if len(v) >= 7 && strings.EqualFold(v[:7], "http://") {
		v = v[7:]
	}
	if strings.ContainsAny(v, "/?#@\\ \t") {
		return prefillerAddr{}, true, errors.New("not a host:port: a prefiller is named by its address alone, reached over http")
	}
	host, portText, err := net.SplitHostPort(v)
	if err != nil {
		return prefillerAddr{}, true, errors.New("not a host:port (an IPv6 address goes in brackets)")
	}
	if p.port, err = parsePort(portText); err != nil {
		return prefillerAddr{}, true, fmt.Errorf("port: %w", err)
	}
	if addr, err := netip.ParseAddr(host); err == nil {
		if addr.Zone() != "" {
			return prefillerAddr{}, true, errors.New("an IPv6 zone names an interface, not a prefiller")
		}
		p.addr = addr.Unmap()
		p.host = p.addr.String()
		return p, true, nil
	}
	if p.host, err = dnsName(host); err != nil {
		return prefillerAddr{}, true, err
	}
	return p, true, nil
}

// dnsName checks a host that is no IP address, in lower case without its trailing dot: letters,
// digits and hyphens in labels of 1 to 63, 253 in all, and a last label that is not all digits
// (RFC 3696, section 2). What fails is refused rather than resolved: a resolver may read
// "010.0.0.1" or "0x7f.1" as an address that the allowlist's CIDRs never saw.
func dnsName(host string) (string, error) {
	name := strings.TrimSuffix(strings.ToLower(host), ".")
	if name == "" || len(name) > 253 {
		return "", errors.New("not a host name")
	}
	labels := strings.Split(name, ".")
	for _, l := range labels {
		if l == "" || len(l) > 63 || l[0] == '-' || l[len(l)-1] == '-' || strings.Trim(l, "abcdefghijklmnopqrstuvwxyz0123456789-") != "" {
			return "", errors.New("not a host name: labels of letters, digits and hyphens")
		}
	}
	if strings.Trim(labels[len(labels)-1], "0123456789") == "" {
		return "", errors.New("neither an IP address nor a host name")
	}
	return name, nil
}

// parsePort reads a TCP port, 1 to 65535, in decimal digits.
func parsePort(s string) (uint16, error) {
	if s == "" || strings.Trim(s, "0123456789") != "" {
		return 0, errors.New("not a number")
	}
	n, err := strconv.ParseUint(s, 10, 16)
	if err != nil || n == 0 {
		return 0, errors.New("not a port from 1 to 65535")
	}
	return uint16(n), nil
}
