"""A fake `RegistrationDriver` for CPU tests: records every call, fails where told to."""


class FakeDriver:
    def __init__(
        self,
        read_only=True,
        fail_register_at=None,
        fail_unregister=(),
        raise_at=None,
        unpinned=(),
        stuck=False,
        raises=RuntimeError,
        raises_registered=False,
    ):
        self.calls = []
        self.registered = {}  # address -> nbytes
        self.read_only = read_only
        self.fail_register_at = fail_register_at  # index of the register call that fails
        self.fail_unregister = list(fail_unregister)  # addresses whose next unregister fails (once each)
        self.raise_at = raise_at  # index of the register call that raises
        self.raises = raises  # what it raises (KeyboardInterrupt: Ctrl-C during registration)
        self.raises_registered = raises_registered  # it raises with the range registered (a signal as the call returns)
        self.unpinned = set(unpinned)  # probe addresses that never read as registered
        self.stuck = stuck  # every unregister fails
        self.cleared = []
        self.on_unregister = None  # called before each unregister (tests record state there)

    def read_only_supported(self):
        self.calls.append(("attribute", 113))
        return self.read_only

    def register(self, address, nbytes, flags):
        index = sum(1 for c in self.calls if c[0] == "register")
        self.calls.append(("register", address, nbytes, flags))
        if index == self.raise_at:
            if self.raises_registered:
                self.registered[address] = nbytes
            raise self.raises("driver exploded")
        if index == self.fail_register_at:
            return 2  # cudaErrorMemoryAllocation
        self.registered[address] = nbytes
        return 0

    def unregister(self, address):
        if self.on_unregister is not None:
            self.on_unregister(address)
        self.calls.append(("unregister", address))
        if self.stuck or address in self.fail_unregister:
            if not self.stuck:
                self.fail_unregister.remove(address)
            return 1
        del self.registered[address]
        return 0

    def is_registered(self, address):
        inside = any(start <= address < start + n for start, n in self.registered.items())
        return inside and address not in self.unpinned

    def clear_error(self, code):
        self.cleared.append(code)

    def error_name(self, code):
        return f"fake error {code}"
