package main

import (
	"crypto/ed25519"
	"encoding/base64"
	"encoding/json"
	"regexp"
	"strings"
	"time"

	"go.temporal.io/server/common/authorization"
)

// Kind of caller a token names.
type Kind int

const (
	KindNode Kind = iota + 1
	KindOperator
	KindControlPlane
)

// Identity is what a verified token says, carried in Claims.Extensions to the Authorizer.
type Identity struct {
	Kind   Kind
	NodeID string // KindNode only
}

// The token's claims: core/temporal_identity.py is the other half of this format.
type tokenClaims struct {
	Subject  string `json:"sub"`
	Expires  int64  `json:"exp"`
	IssuedAt int64  `json:"iat"`
}

const (
	tokenVersion = "v1"
	// A token issued "in the future" by more than this is refused (clocks a little apart are not).
	clockSkew = 60 * time.Second
)

var nodeUUID = regexp.MustCompile(`^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$`)

// TokenClaimMapper turns the `authorization: Bearer v1.<claims>.<signature>` header into
// claims. A missing, malformed, forged or expired token maps to no claims (nil), which the
// Authorizer refuses for everything but the health and system-info calls.
type TokenClaimMapper struct {
	Keys []ed25519.PublicKey
	Now  func() time.Time // for tests; time.Now when nil
}

func (m *TokenClaimMapper) GetClaims(info *authorization.AuthInfo) (*authorization.Claims, error) {
	identity, subject := m.verify(info.AuthToken)
	if identity == nil {
		return nil, nil
	}
	claims := &authorization.Claims{Subject: subject, Extensions: identity}
	if identity.Kind == KindControlPlane {
		claims.System = authorization.RoleAdmin
	}
	return claims, nil
}

func (m *TokenClaimMapper) verify(header string) (*Identity, string) {
	token, found := strings.CutPrefix(header, "Bearer ")
	if !found {
		return nil, ""
	}
	parts := strings.Split(token, ".")
	if len(parts) != 3 || parts[0] != tokenVersion {
		return nil, ""
	}
	signature, err := base64.RawURLEncoding.DecodeString(parts[2])
	if err != nil {
		return nil, ""
	}
	signed := []byte(parts[0] + "." + parts[1])
	verified := false
	for _, key := range m.Keys {
		if ed25519.Verify(key, signed, signature) {
			verified = true
			break
		}
	}
	if !verified {
		return nil, ""
	}
	payload, err := base64.RawURLEncoding.DecodeString(parts[1])
	if err != nil {
		return nil, ""
	}
	var claims tokenClaims
	if err := json.Unmarshal(payload, &claims); err != nil {
		return nil, ""
	}
	now := time.Now
	if m.Now != nil {
		now = m.Now
	}
	at := now()
	if !at.Before(time.Unix(claims.Expires, 0)) || time.Unix(claims.IssuedAt, 0).After(at.Add(clockSkew)) {
		return nil, ""
	}
	switch {
	case claims.Subject == "control-plane":
		return &Identity{Kind: KindControlPlane}, claims.Subject
	case claims.Subject == "operator":
		return &Identity{Kind: KindOperator}, claims.Subject
	case strings.HasPrefix(claims.Subject, "node:") && nodeUUID.MatchString(claims.Subject[len("node:"):]):
		return &Identity{Kind: KindNode, NodeID: claims.Subject[len("node:"):]}, claims.Subject
	}
	return nil, ""
}
