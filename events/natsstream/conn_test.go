package natsstream

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/nats-io/jwt/v2"
	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nkeys"
	"github.com/stretchr/testify/require"

	"github.com/kvsource/kvsource/internal/testenv"
)

// startServer starts an in-process NATS server with opts (host and port
// filled in) and returns its URL.
func startServer(t *testing.T, opts *server.Options) string {
	t.Helper()
	opts.Host, opts.Port, opts.NoLog, opts.NoSigs = "127.0.0.1", testenv.FreePort(t), true, true
	srv, err := server.NewServer(opts)
	require.NoError(t, err)
	srv.Start()
	t.Cleanup(func() { srv.Shutdown(); srv.WaitForShutdown() })
	require.True(t, srv.ReadyForConnections(10*time.Second))
	scheme := "nats"
	if opts.TLSConfig != nil {
		scheme = "tls"
	}
	return fmt.Sprintf("%s://127.0.0.1:%d", scheme, opts.Port)
}

func writeFile(t *testing.T, name string, data []byte) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), name)
	require.NoError(t, os.WriteFile(p, data, 0o600))
	return p
}

// testPKI is a CA, a server certificate for 127.0.0.1 and a client
// certificate, made at run time.
type testPKI struct {
	caFile, certFile, keyFile string // the CA, the client's certificate and key
	server                    *tls.Config
}

func newTestPKI(t *testing.T) testPKI {
	t.Helper()
	newKey := func() *ecdsa.PrivateKey {
		k, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
		require.NoError(t, err)
		return k
	}
	caKey := newKey()
	caTmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "kvsource test CA"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour), IsCA: true, BasicConstraintsValid: true,
		KeyUsage: x509.KeyUsageCertSign}
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, &caKey.PublicKey, caKey)
	require.NoError(t, err)
	ca, err := x509.ParseCertificate(caDER)
	require.NoError(t, err)
	issue := func(serial int64, usage x509.ExtKeyUsage) ([]byte, *ecdsa.PrivateKey) {
		k := newKey()
		tmpl := &x509.Certificate{SerialNumber: big.NewInt(serial), Subject: pkix.Name{CommonName: "kvsource test"},
			NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour), IPAddresses: []net.IP{net.IPv4(127, 0, 0, 1)},
			KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{usage}}
		der, err := x509.CreateCertificate(rand.Reader, tmpl, ca, &k.PublicKey, caKey)
		require.NoError(t, err)
		return der, k
	}
	pemOf := func(typ string, der []byte) []byte { return pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der}) }
	keyPEM := func(k *ecdsa.PrivateKey) []byte {
		der, err := x509.MarshalECPrivateKey(k)
		require.NoError(t, err)
		return pemOf("EC PRIVATE KEY", der)
	}
	srvDER, srvKey := issue(2, x509.ExtKeyUsageServerAuth)
	srvCert, err := tls.X509KeyPair(pemOf("CERTIFICATE", srvDER), keyPEM(srvKey))
	require.NoError(t, err)
	cliDER, cliKey := issue(3, x509.ExtKeyUsageClientAuth)
	pool := x509.NewCertPool()
	pool.AddCert(ca)
	return testPKI{
		caFile:   writeFile(t, "ca.pem", pemOf("CERTIFICATE", caDER)),
		certFile: writeFile(t, "client.pem", pemOf("CERTIFICATE", cliDER)),
		keyFile:  writeFile(t, "client-key.pem", keyPEM(cliKey)),
		server: &tls.Config{Certificates: []tls.Certificate{srvCert}, ClientCAs: pool, ClientAuth: tls.RequireAndVerifyClientCert,
			MinVersion: tls.VersionTLS12},
	}
}

// operatorServer is a server in operator mode with one account and a
// .creds file of one of its users.
func operatorServer(t *testing.T) (opts *server.Options, creds string) {
	t.Helper()
	okp, err := nkeys.CreateOperator()
	require.NoError(t, err)
	opub, err := okp.PublicKey()
	require.NoError(t, err)
	oc := jwt.NewOperatorClaims(opub)
	ojwt, err := oc.Encode(okp)
	require.NoError(t, err)
	oclaims, err := jwt.DecodeOperatorClaims(ojwt)
	require.NoError(t, err)
	akp, err := nkeys.CreateAccount()
	require.NoError(t, err)
	apub, err := akp.PublicKey()
	require.NoError(t, err)
	ajwt, err := jwt.NewAccountClaims(apub).Encode(okp)
	require.NoError(t, err)
	ukp, err := nkeys.CreateUser()
	require.NoError(t, err)
	upub, err := ukp.PublicKey()
	require.NoError(t, err)
	uc := jwt.NewUserClaims(upub)
	uc.IssuerAccount = apub
	ujwt, err := uc.Encode(akp)
	require.NoError(t, err)
	seed, err := ukp.Seed()
	require.NoError(t, err)
	cfg, err := jwt.FormatUserConfig(ujwt, seed)
	require.NoError(t, err)
	resolver := &server.MemAccResolver{}
	require.NoError(t, resolver.Store(apub, ajwt))
	return &server.Options{TrustedOperators: []*jwt.OperatorClaims{oclaims}, AccountResolver: resolver}, writeFile(t, "user.creds", cfg)
}

// Each kind of credentials, and TLS with a client certificate, connects
// to a server that requires it; without them, or with wrong ones, the
// connection is refused.
func TestConnConfigConnectsWithEachKindOfNATSSecurity(t *testing.T) {
	ukp, err := nkeys.CreateUser()
	require.NoError(t, err)
	upub, err := ukp.PublicKey()
	require.NoError(t, err)
	useed, err := ukp.Seed()
	require.NoError(t, err)
	otherKP, err := nkeys.CreateUser()
	require.NoError(t, err)
	otherSeed, err := otherKP.Seed()
	require.NoError(t, err)
	opOpts, creds := operatorServer(t)
	pki := newTestPKI(t)

	for _, tc := range []struct {
		name        string
		server      *server.Options
		good, wrong ConnConfig
	}{
		{name: "token", server: &server.Options{Authorization: "s3cret"},
			good: ConnConfig{Token: "s3cret"}, wrong: ConnConfig{Token: "guess"}},
		{name: "user and password", server: &server.Options{Username: "relay", Password: "pw"},
			good: ConnConfig{User: "relay", Password: "pw"}, wrong: ConnConfig{User: "relay", Password: "guess"}},
		{name: "nkey seed", server: &server.Options{Nkeys: []*server.NkeyUser{{Nkey: upub}}},
			good: ConnConfig{NKeySeedFile: writeFile(t, "user.nk", useed)}, wrong: ConnConfig{NKeySeedFile: writeFile(t, "other.nk", otherSeed)}},
		{name: "creds file", server: opOpts, good: ConnConfig{CredsFile: creds}, wrong: ConnConfig{Token: "guess"}},
		{name: "TLS with a client certificate", server: &server.Options{TLSConfig: pki.server, TLSVerify: true, TLSTimeout: 2},
			good: ConnConfig{TLSCA: pki.caFile, TLSCert: pki.certFile, TLSKey: pki.keyFile}, wrong: ConnConfig{TLSCA: pki.caFile}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			url := startServer(t, tc.server)
			connect := func(c ConnConfig) error {
				opts, err := c.Options()
				require.NoError(t, err)
				nc, err := nats.Connect(url, append(opts, nats.MaxReconnects(0), nats.Timeout(2*time.Second))...)
				if err == nil {
					defer nc.Close()
					err = nc.Flush()
				}
				return err
			}
			require.NoError(t, connect(tc.good))
			require.Error(t, connect(tc.wrong))
			require.Error(t, connect(ConnConfig{}))
		})
	}
}

func TestConnConfigRefusesConfigsThatCannotWork(t *testing.T) {
	missing := filepath.Join(t.TempDir(), "missing")
	notPEM := writeFile(t, "not.pem", []byte("not a certificate"))
	for _, c := range []ConnConfig{
		{Token: "t", User: "u", Password: "p"},
		{CredsFile: missing, Token: "t"},
		{Password: "p"},
		{CredsFile: missing},
		{NKeySeedFile: missing},
		{NKeySeedFile: notPEM},
		{TLSCA: missing},
		{TLSCA: notPEM},
		{TLSCert: notPEM},
		{TLSKey: notPEM},
		{TLSCert: notPEM, TLSKey: notPEM},
	} {
		_, err := c.Options()
		require.ErrorIs(t, err, ErrConfig, "%+v", c)
	}
}
