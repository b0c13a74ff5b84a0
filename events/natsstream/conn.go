package natsstream

import (
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"os"

	"github.com/nats-io/nats.go"
)

// ConnConfig is how a relay or replica proves who it is to NATS and
// secures its connection: NATS's own security, which decides who may
// publish on the event subjects and the buckets, and so who can put
// holders and sources tables in front of every replica (see the package
// doc's Security section). The zero value connects without credentials
// and without TLS unless the URL says tls://.
//
// At most one kind of credentials may be set: CredsFile (a user JWT and
// its nkey seed, for servers in operator mode), NKeySeedFile, User and
// Password, or Token. Credentials in the URL (nats://user:pass@host)
// work too, and are overridden by these.
type ConnConfig struct {
	// CredsFile is a .creds file, as nsc writes it.
	CredsFile string
	// NKeySeedFile holds a user nkey seed ("SU..."); the server knows
	// the public key.
	NKeySeedFile string
	// User and Password authenticate with a user name and password.
	User, Password string
	// Token authenticates with a token.
	Token string
	// TLSCA is a PEM file of the certificate authorities that sign the
	// server's certificate; setting it requires TLS. Empty: the system's
	// roots, when TLS is used.
	TLSCA string
	// TLSCert and TLSKey are PEM files of a client certificate and its
	// key, for a server that verifies clients (verify: true); both or
	// neither. Setting them requires TLS.
	TLSCert, TLSKey string
}

// Options returns c as options for nats.Connect. Files are read now, so
// that a missing or malformed one is an error here rather than a failed
// connection later; the errors wrap ErrConfig.
func (c ConnConfig) Options() ([]nats.Option, error) {
	kinds := 0
	for _, set := range []bool{c.CredsFile != "", c.NKeySeedFile != "", c.User != "" || c.Password != "", c.Token != ""} {
		if set {
			kinds++
		}
	}
	if kinds > 1 {
		return nil, fmt.Errorf("%w: set one of a creds file, an nkey seed, a user and password, or a token", ErrConfig)
	}
	if c.Password != "" && c.User == "" {
		return nil, fmt.Errorf("%w: a NATS password needs a user", ErrConfig)
	}
	var opts []nats.Option
	switch {
	case c.CredsFile != "":
		if _, err := os.Stat(c.CredsFile); err != nil {
			return nil, fmt.Errorf("%w: NATS creds file: %w", ErrConfig, err)
		}
		opts = append(opts, nats.UserCredentials(c.CredsFile))
	case c.NKeySeedFile != "":
		o, err := nats.NkeyOptionFromSeed(c.NKeySeedFile)
		if err != nil {
			return nil, fmt.Errorf("%w: NATS nkey seed: %w", ErrConfig, err)
		}
		opts = append(opts, o)
	case c.User != "":
		opts = append(opts, nats.UserInfo(c.User, c.Password))
	case c.Token != "":
		opts = append(opts, nats.Token(c.Token))
	}
	if (c.TLSCert == "") != (c.TLSKey == "") {
		return nil, fmt.Errorf("%w: a NATS client certificate needs its key, and the key its certificate", ErrConfig)
	}
	if c.TLSCA == "" && c.TLSCert == "" {
		return opts, nil
	}
	tc := &tls.Config{MinVersion: tls.VersionTLS12}
	if c.TLSCA != "" {
		pem, err := os.ReadFile(c.TLSCA)
		if err != nil {
			return nil, fmt.Errorf("%w: NATS TLS CA: %w", ErrConfig, err)
		}
		tc.RootCAs = x509.NewCertPool()
		if !tc.RootCAs.AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("%w: NATS TLS CA %s: no PEM certificate", ErrConfig, c.TLSCA)
		}
	}
	if c.TLSCert != "" {
		cert, err := tls.LoadX509KeyPair(c.TLSCert, c.TLSKey)
		if err != nil {
			return nil, fmt.Errorf("%w: NATS TLS client certificate: %w", ErrConfig, err)
		}
		tc.Certificates = []tls.Certificate{cert}
	}
	return append(opts, nats.Secure(tc)), nil
}
