package interop

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
	"time"

	"google.golang.org/grpc/credentials"
)

// ServerName is the name the test certificate is issued to, so that a
// client checks it whatever address it dials (grpc-go's interop client
// calls this --server_host_override).
const ServerName = "rdmagrpc.interop.test"

// PKI is a throwaway certificate authority and the certificates it issued,
// as PEM files in Dir: ca.pem, server.pem and server.key, client.pem and
// client.key. Both processes of a test read the same files.
type PKI struct{ Dir string }

// NewPKI issues a CA, a server certificate for ServerName and 127.0.0.1,
// and a client certificate, valid for a day, into dir.
func NewPKI(dir string) (PKI, error) {
	p := PKI{Dir: dir}
	caKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return p, fmt.Errorf("interop: CA key: %w", err)
	}
	now := time.Now()
	ca := &x509.Certificate{
		SerialNumber:          big.NewInt(1),
		Subject:               pkix.Name{CommonName: "rdmagrpc interop CA"},
		NotBefore:             now.Add(-time.Hour),
		NotAfter:              now.Add(24 * time.Hour),
		IsCA:                  true,
		BasicConstraintsValid: true,
		KeyUsage:              x509.KeyUsageCertSign,
	}
	caDER, err := x509.CreateCertificate(rand.Reader, ca, ca, &caKey.PublicKey, caKey)
	if err != nil {
		return p, fmt.Errorf("interop: CA certificate: %w", err)
	}
	if ca, err = x509.ParseCertificate(caDER); err != nil {
		return p, fmt.Errorf("interop: CA certificate: %w", err)
	}
	if err := writePEM(filepath.Join(dir, "ca.pem"), "CERTIFICATE", caDER); err != nil {
		return p, err
	}
	issue := func(name string, serial int64, usage x509.ExtKeyUsage, dns []string, ips []net.IP) error {
		key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
		if err != nil {
			return fmt.Errorf("interop: %s key: %w", name, err)
		}
		tmpl := &x509.Certificate{
			SerialNumber: big.NewInt(serial),
			Subject:      pkix.Name{CommonName: "rdmagrpc interop " + name},
			NotBefore:    now.Add(-time.Hour),
			NotAfter:     now.Add(24 * time.Hour),
			KeyUsage:     x509.KeyUsageDigitalSignature,
			ExtKeyUsage:  []x509.ExtKeyUsage{usage},
			DNSNames:     dns,
			IPAddresses:  ips,
		}
		der, err := x509.CreateCertificate(rand.Reader, tmpl, ca, &key.PublicKey, caKey)
		if err != nil {
			return fmt.Errorf("interop: %s certificate: %w", name, err)
		}
		keyDER, err := x509.MarshalECPrivateKey(key)
		if err != nil {
			return fmt.Errorf("interop: %s key: %w", name, err)
		}
		if err := writePEM(filepath.Join(dir, name+".pem"), "CERTIFICATE", der); err != nil {
			return err
		}
		return writePEM(filepath.Join(dir, name+".key"), "EC PRIVATE KEY", keyDER)
	}
	if err := issue("server", 2, x509.ExtKeyUsageServerAuth, []string{ServerName}, []net.IP{net.IPv4(127, 0, 0, 1)}); err != nil {
		return p, err
	}
	return p, issue("client", 3, x509.ExtKeyUsageClientAuth, nil, nil)
}

func writePEM(path, typ string, der []byte) error {
	if err := os.WriteFile(path, pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der}), 0o600); err != nil {
		return fmt.Errorf("interop: %w", err)
	}
	return nil
}

// ServerCreds are the server's TLS credentials; with mutual, it requires
// and checks a client certificate issued by the CA.
func (p PKI) ServerCreds(mutual bool) (credentials.TransportCredentials, error) {
	ca := ""
	if mutual {
		ca = filepath.Join(p.Dir, "ca.pem")
	}
	return ServerTLS(filepath.Join(p.Dir, "server.pem"), filepath.Join(p.Dir, "server.key"), ca)
}

// ClientCreds are the client's TLS credentials, trusting the CA and
// checking ServerName; with mutual, it presents its client certificate.
func (p PKI) ClientCreds(mutual bool) (credentials.TransportCredentials, error) {
	cert, key := "", ""
	if mutual {
		cert, key = filepath.Join(p.Dir, "client.pem"), filepath.Join(p.Dir, "client.key")
	}
	return ClientTLS(filepath.Join(p.Dir, "ca.pem"), ServerName, cert, key)
}

// ServerTLS are TLS credentials from PEM files: the server's certificate
// and key and, when clientCAFile is not empty, the CAs whose client
// certificates it requires (mutual TLS).
func ServerTLS(certFile, keyFile, clientCAFile string) (credentials.TransportCredentials, error) {
	cert, err := tls.LoadX509KeyPair(certFile, keyFile)
	if err != nil {
		return nil, fmt.Errorf("interop: server certificate: %w", err)
	}
	cfg := &tls.Config{Certificates: []tls.Certificate{cert}, MinVersion: tls.VersionTLS12}
	if clientCAFile != "" {
		if cfg.ClientCAs, err = pool(clientCAFile); err != nil {
			return nil, err
		}
		cfg.ClientAuth = tls.RequireAndVerifyClientCert
	}
	return credentials.NewTLS(cfg), nil
}

// ClientTLS are TLS credentials from PEM files: the CAs to trust (the
// system's when caFile is empty), the name to check in the server's
// certificate (the dialed host when empty) and, when certFile is not
// empty, the client's certificate and key (mutual TLS).
func ClientTLS(caFile, serverName, certFile, keyFile string) (credentials.TransportCredentials, error) {
	cfg := &tls.Config{ServerName: serverName, MinVersion: tls.VersionTLS12}
	var err error
	if caFile != "" {
		if cfg.RootCAs, err = pool(caFile); err != nil {
			return nil, err
		}
	}
	if certFile != "" {
		cert, err := tls.LoadX509KeyPair(certFile, keyFile)
		if err != nil {
			return nil, fmt.Errorf("interop: client certificate: %w", err)
		}
		cfg.Certificates = []tls.Certificate{cert}
	}
	return credentials.NewTLS(cfg), nil
}

func pool(file string) (*x509.CertPool, error) {
	b, err := os.ReadFile(file)
	if err != nil {
		return nil, fmt.Errorf("interop: %w", err)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(b) {
		return nil, fmt.Errorf("interop: no certificate in %s", file)
	}
	return pool, nil
}
