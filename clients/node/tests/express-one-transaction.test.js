'use strict';
// The Express middleware with oneTransaction: the claim, the handler's writes and complete in one transaction.
require('./express-suite')({ oneTransaction: true });
