package api

import (
	"crypto/rand"
	"encoding/hex"
)

// NewID is a random id of 32 hex digits. Ids of one length are prefix-free.
func NewID() string {
	var b [16]byte
	rand.Read(b[:])
	return hex.EncodeToString(b[:])
}
