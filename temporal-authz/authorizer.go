package main

import (
	"context"
	"strings"

	workflowservice "go.temporal.io/api/workflowservice/v1"
	"go.temporal.io/server/common/api"
	"go.temporal.io/server/common/authorization"
	"go.temporal.io/server/common/log"
	"go.temporal.io/server/common/log/tag"
)

// Authorizer decides each frontend call by the identity the TokenClaimMapper found:
//   - the control plane (and the server's own internal-frontend, whose claims are RoleAdmin)
//     may call anything;
//   - an operator may call the read-only workflow-service APIs (describe, list, count, history,
//     query, task queues, namespaces) and list search attributes: no writes, no operator or
//     admin service; writes go through the console's audited verbs, made by the control plane;
//   - a node may poll its own activity queue, answer and heartbeat the tasks it holds (by task
//     token), report its presence, and send the progress and stream-attached signals; nothing else;
//   - no identity: nothing but the health check and GetSystemInfo every client calls first.
type Authorizer struct {
	Policy *Policy
	Logger log.Logger
}

var (
	allow = authorization.Result{Decision: authorization.DecisionAllow}
)

// What a node's activity worker calls besides its own work (found by running the Python SDK's
// worker against this server and logging what was refused): it reads its namespace at start,
// and says it stopped at shutdown (ShutdownWorker, allowed below without a sticky queue).
var nodeSDKCalls = map[string]bool{
	"DescribeNamespace": true,
}

// Answering a task it holds: by task token only, never the *ById forms (which name any
// workflow's activity by ids).
var nodeTaskTokenCalls = map[string]bool{
	"RespondActivityTaskCompleted": true,
	"RespondActivityTaskFailed":    true,
	"RespondActivityTaskCanceled":  true,
	"RecordActivityTaskHeartbeat":  true,
}

func (a *Authorizer) Authorize(_ context.Context, claims *authorization.Claims, target *authorization.CallTarget) (authorization.Result, error) {
	if authorization.IsHealthCheckAPI(target.APIName) {
		return allow, nil
	}
	if claims != nil && claims.System&authorization.RoleAdmin != 0 {
		return allow, nil
	}
	var identity *Identity
	if claims != nil {
		identity, _ = claims.Extensions.(*Identity)
	}
	reason := ""
	switch {
	case identity == nil:
		reason = "no valid identity"
	case target.Namespace != a.Policy.Namespace &&
		(identity.Kind == KindNode || target.Namespace != ""):
		// Operators also read cluster-wide (no namespace: ListNamespaces, GetClusterInfo).
		reason = "namespace not allowed"
	case identity.Kind == KindOperator:
		reason = a.operator(target)
	case identity.Kind == KindNode:
		reason = a.node(identity.NodeID, target)
	default:
		reason = "identity not allowed"
	}
	if reason == "" {
		return allow, nil
	}
	subject := ""
	if claims != nil {
		subject = claims.Subject
	}
	a.Logger.Warn("authz: call refused",
		tag.NewStringTag("api", target.APIName),
		tag.NewStringTag("subject", subject),
		tag.NewStringTag("reason", reason))
	return authorization.Result{Decision: authorization.DecisionDeny, Reason: reason}, nil
}

func (a *Authorizer) operator(target *authorization.CallTarget) string {
	if strings.HasPrefix(target.APIName, api.WorkflowServicePrefix) &&
		api.GetMethodMetadata(target.APIName).Access == api.AccessReadOnly {
		return ""
	}
	if target.APIName == api.OperatorServicePrefix+"ListSearchAttributes" {
		return ""
	}
	return "operators may only read"
}

func (a *Authorizer) node(nodeID string, target *authorization.CallTarget) string {
	method, isWorkflowService := strings.CutPrefix(target.APIName, api.WorkflowServicePrefix)
	if !isWorkflowService {
		return "not a workflow-service call"
	}
	p := a.Policy
	switch {
	case nodeSDKCalls[method], nodeTaskTokenCalls[method]:
		return ""
	case method == "PollActivityTaskQueue":
		request, _ := target.Request.(*workflowservice.PollActivityTaskQueueRequest)
		if request.GetTaskQueue().GetName() == p.NodeQueuePrefix+nodeID {
			return ""
		}
		return "a node polls its own task queue only"
	case method == "ShutdownWorker":
		// An activity worker has no sticky queue; naming one would drop a control-plane
		// workflow worker's sticky tasks.
		request, _ := target.Request.(*workflowservice.ShutdownWorkerRequest)
		if request.GetStickyTaskQueue() == "" {
			return ""
		}
		return "a node has no sticky queue"
	case method == "SignalWorkflowExecution":
		request, _ := target.Request.(*workflowservice.SignalWorkflowExecutionRequest)
		workflowID := request.GetWorkflowExecution().GetWorkflowId()
		for _, prefix := range p.NodeSignals[request.GetSignalName()] {
			if strings.HasPrefix(workflowID, prefix) && len(workflowID) > len(prefix) {
				return ""
			}
		}
		return "signal not allowed to a node"
	case method == "SignalWithStartWorkflowExecution":
		request, _ := target.Request.(*workflowservice.SignalWithStartWorkflowExecutionRequest)
		if request.GetWorkflowId() == p.PresenceWorkflowIDPrefix+nodeID &&
			request.GetWorkflowType().GetName() == p.PresenceWorkflowType &&
			request.GetSignalName() == p.PresenceSignal &&
			request.GetTaskQueue().GetName() == p.PresenceTaskQueue &&
			request.GetCronSchedule() == "" {
			return ""
		}
		return "a node reports its own presence only"
	}
	return "not allowed to a node"
}
