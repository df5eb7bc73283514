"""StreamBox: serverless inference functions sharing one GPU runtime through streams.

The function SDK is importable from here without loading torch or any device library:
`streambox.function`, `streambox.FunctionMeta`, `streambox.Context`, `streambox.Handle`,
`streambox.InvalidInput` (raised by a handler for a bad event: the gateway answers 400).
"""

from streambox.sdk import Context, FunctionMeta, Future, Handle, InvalidInput, function, meta_of

__all__ = ["Context", "FunctionMeta", "Future", "Handle", "InvalidInput", "function", "meta_of"]
