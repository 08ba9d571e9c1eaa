"""Stop gracefully: the flag, the operator token, the lifecycle and the audit trail."""
