package conn

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"math/big"
	"net"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/health"
	healthgrpc "google.golang.org/grpc/health/grpc_health_v1"
)

// testTLS is a self-signed certificate for 127.0.0.1 and the credentials
// of a server and a client that trusts it.
func testTLS(t *testing.T) (server, client credentials.TransportCredentials) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1),
		Subject:      pkix.Name{CommonName: "rdmagrpc test"},
		NotBefore:    time.Now().Add(-time.Hour),
		NotAfter:     time.Now().Add(time.Hour),
		IPAddresses:  []net.IP{net.IPv4(127, 0, 0, 1)},
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		t.Fatal(err)
	}
	pool := x509.NewCertPool()
	pool.AddCert(cert)
	server = credentials.NewTLS(&tls.Config{Certificates: []tls.Certificate{{Certificate: [][]byte{der}, PrivateKey: key}}})
	client = credentials.NewTLS(&tls.Config{RootCAs: pool, ServerName: "127.0.0.1"})
	return server, client
}

// serveHealthTLS serves grpc-go's health service on l with TLS.
func serveHealthTLS(t *testing.T, l net.Listener, creds credentials.TransportCredentials) {
	s := grpc.NewServer(grpc.Creds(creds))
	healthgrpc.RegisterHealthServer(s, health.NewServer())
	go s.Serve(l)
	t.Cleanup(s.Stop)
}

// An rdmagrpc client with TLS credentials reaches a plain grpc-go TLS
// server, on first contact and after: the negotiation never puts its
// preface in front of the ClientHello.
func TestTLSClientReachesPlainTLSServer(t *testing.T) {
	srvCreds, cliCreds := testTLS(t)
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	serveHealthTLS(t, l, srvCreds)
	dial, got := recording()
	for i := range 2 {
		start := time.Now()
		checkCreds(t, l.Addr().String(), cliCreds, dial)
		c := <-got
		if s := c.Stats(); s.Provider != "tcp" {
			t.Errorf("connection %d: provider %q (%s)", i+1, s.Provider, s.ProviderReason)
		}
		t.Logf("connection %d: answered in %v over TCP", i+1, time.Since(start))
	}
}

// Two rdmagrpc ends with TLS move their bytes over RDMA from the first
// connection on: the dial asks on a probe connection of its own whether
// the server offers RDMA (its own connection must carry the ClientHello
// first), upgrades, and runs TLS inside the RDMA connection. A plain TLS
// client reaches the same server over TCP.
func TestTLSBetweenRdmagrpcEnds(t *testing.T) {
	srvCreds, cliCreds := testTLS(t)
	l, err := Listen(t.Context(), testAddr())
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	ll := l.(*Listener)
	forgetFailedUpgrade(ll.l.Addr().String())
	forgetServer(addr, ll.name)
	t.Cleanup(func() { forgetServer(addr, ll.name) })
	cl := capture{l, make(chan net.Conn, 16)}
	serveHealthTLS(t, cl, srvCreds)

	dial, got := recording()
	for _, which := range []string{"first", "second"} {
		checkCreds(t, addr, cliCreds, dial)
		sc := (<-cl.got).(*Conn)
		if err := sc.Handshake(t.Context()); err != nil {
			t.Fatal(err)
		}
		if s := sc.Stats(); s.Provider != ll.name {
			t.Errorf("server side of the %s TLS connection: provider %q (%s), want %s", which, s.Provider, s.ProviderReason, ll.name)
		}
		if s := (<-got).Stats(); s.Provider != ll.name {
			t.Errorf("client side of the %s TLS connection: provider %q (%s), want %s", which, s.Provider, s.ProviderReason, ll.name)
		}
	}
	if len(cl.got) != 0 {
		t.Errorf("%d more connections accepted: a probe reached Accept", len(cl.got))
	}

	checkCreds(t, addr, cliCreds, nil) // a plain grpc-go TLS client
	wantProvider(t, "server side of the plain TLS client's", (<-cl.got).(*Conn), "tcp", "")
}
