package authcallout

import (
	"encoding/base64"
	"encoding/json"
	"errors"
	"strings"
	"time"
)

// tokenExpiry is the exp claim of a JWT. It is read only from a token the API server has just accepted
// (TokenReview says nothing of the expiry), so the claims are the API server's own.
func tokenExpiry(token string) (time.Time, error) {
	parts := strings.Split(token, ".")
	if len(parts) != 3 {
		return time.Time{}, errors.New("token is not a JWT")
	}
	payload, err := base64.RawURLEncoding.DecodeString(strings.TrimRight(parts[1], "="))
	if err != nil {
		return time.Time{}, errors.New("token's claims are not base64url")
	}
	var claims struct {
		Exp *int64 `json:"exp"`
	}
	if err := json.Unmarshal(payload, &claims); err != nil {
		return time.Time{}, errors.New("token's claims are not JSON")
	}
	if claims.Exp == nil {
		return time.Time{}, errors.New("token has no expiry (a legacy Secret token?): use a bound token (a projected volume, or kubectl create token)")
	}
	return time.Unix(*claims.Exp, 0), nil
}
