// Run-time loading of libibverbs and librdmacm (see abi.h).
#include <dlfcn.h>
#include <stdio.h>
#include <string.h>
#include "abi.h"

struct shim_lib shim_lib;

static void *libibverbs, *librdmacm;

// resolve fills one member of shim_lib, or names what is missing.
static int resolve(void *lib, const char *libname, const char *sym, void **slot, char *err,
		   size_t errlen)
{
	*slot = dlsym(lib, sym);
	if (*slot)
		return 0;
	snprintf(err, errlen, "%s has no %s (rdma-core too old?)", libname, sym);
	return -1;
}

static void unload(void)
{
	memset(&shim_lib, 0, sizeof(shim_lib));
	if (librdmacm)
		dlclose(librdmacm);
	if (libibverbs)
		dlclose(libibverbs);
	librdmacm = libibverbs = NULL;
}

int shim_load(char *err, size_t errlen)
{
	const char *e;

	if (libibverbs && librdmacm)
		return 0;
	// The sonames: ABI version 1 of both libraries, the one rdma-core has
	// shipped since it replaced the separate libibverbs and librdmacm.
	libibverbs = dlopen("libibverbs.so.1", RTLD_NOW | RTLD_LOCAL);
	if (!libibverbs) {
		e = dlerror();
		snprintf(err, errlen, "%s", e ? e : "dlopen libibverbs.so.1 failed");
		return -1;
	}
	librdmacm = dlopen("librdmacm.so.1", RTLD_NOW | RTLD_LOCAL);
	if (!librdmacm) {
		e = dlerror();
		snprintf(err, errlen, "%s", e ? e : "dlopen librdmacm.so.1 failed");
		unload();
		return -1;
	}
#define SHIM_RESOLVE_IBV(ret, name, params)                                                \
	if (resolve(libibverbs, "libibverbs.so.1", #name, (void **)&shim_lib.name, err, errlen)) { \
		unload();                                                                  \
		return -1;                                                                 \
	}
#define SHIM_RESOLVE_CM(ret, name, params)                                                 \
	if (resolve(librdmacm, "librdmacm.so.1", #name, (void **)&shim_lib.name, err, errlen)) { \
		unload();                                                                  \
		return -1;                                                                 \
	}
	SHIM_IBVERBS_FUNCS(SHIM_RESOLVE_IBV)
	SHIM_RDMACM_FUNCS(SHIM_RESOLVE_CM)
	return 0;
}

int shim_loaded(void)
{
#define SHIM_CHECK(ret, name, params)                                                      \
	if (!shim_lib.name)                                                                \
		return 0;
	SHIM_IBVERBS_FUNCS(SHIM_CHECK)
	SHIM_RDMACM_FUNCS(SHIM_CHECK)
	return 1;
}
