"""The types that cross a process boundary: workflow, activity and host-task inputs and
results, update and query payloads, task and workflow names, error types and the lifecycle
states they carry. The gateway, workflows, activities and the node agent all import this
package; it imports none of them (only core/ and libraries)."""
