package main

import (
	"crypto/ed25519"
	"crypto/x509"
	"encoding/json"
	"encoding/pem"
	"fmt"
	"os"
)

// Policy is what the server is told by the control plane (devstack/temporal_authz.py writes
// it from the contracts, so the names live in one place): the keys tokens are signed with and
// the only names a node may use.
type Policy struct {
	// PEM public keys (SubjectPublicKeyInfo) any of which may sign a token: more than one
	// while a signing key is being rotated.
	PublicKeysPEM []string `json:"public_keys"`
	// The one namespace nodes and operators may address (the control plane may address any).
	Namespace string `json:"namespace"`
	// A node's activity queue is NodeQueuePrefix + its id, e.g. node-<uuid>.
	NodeQueuePrefix string `json:"node_queue_prefix"`
	// The agent's presence report: signal-with-start of PresenceWorkflowType with id
	// PresenceWorkflowIDPrefix + its id, signal PresenceSignal, on PresenceTaskQueue.
	PresenceWorkflowIDPrefix string `json:"presence_workflow_id_prefix"`
	PresenceWorkflowType     string `json:"presence_workflow_type"`
	PresenceSignal           string `json:"presence_signal"`
	PresenceTaskQueue        string `json:"presence_task_queue"`
	// Signal name -> the workflow id prefixes a node may send it to (host-task progress to
	// allocations and storage attachments, stream attached to terminal sessions).
	NodeSignals map[string][]string `json:"node_signals"`

	PublicKeys []ed25519.PublicKey `json:"-"`
}

func LoadPolicy(file string) (*Policy, error) {
	raw, err := os.ReadFile(file)
	if err != nil {
		return nil, err
	}
	var policy Policy
	if err := json.Unmarshal(raw, &policy); err != nil {
		return nil, fmt.Errorf("%s: %w", file, err)
	}
	for _, text := range policy.PublicKeysPEM {
		block, _ := pem.Decode([]byte(text))
		if block == nil {
			return nil, fmt.Errorf("%s: a public key is not PEM", file)
		}
		parsed, err := x509.ParsePKIXPublicKey(block.Bytes)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", file, err)
		}
		key, ok := parsed.(ed25519.PublicKey)
		if !ok {
			return nil, fmt.Errorf("%s: a public key is not Ed25519", file)
		}
		policy.PublicKeys = append(policy.PublicKeys, key)
	}
	switch {
	case len(policy.PublicKeys) == 0:
		return nil, fmt.Errorf("%s: no public key", file)
	case policy.Namespace == "" || policy.NodeQueuePrefix == "" || policy.PresenceWorkflowIDPrefix == "":
		return nil, fmt.Errorf("%s: namespace, node_queue_prefix and presence_workflow_id_prefix are required", file)
	}
	return &policy, nil
}
